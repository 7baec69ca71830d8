// "auto" in a DeepSpeed config (zero_optimization.stage, offload_*.device):
// the estimator's cheapest configuration that fits what is free.
#include "zeroshard/deepspeed_config.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cmath>
#include <string>

namespace zeroshard {
namespace {

StateKind state_kind_of(const DeepSpeedConfig& config) {
  if (config.optimizer_type != "SGD") {
    // Adam, AdamW, or none given (the caller's: assume Adam's states). Muon:
    // Adam's two states per element bound its matrices' one from above.
    const auto amsgrad = config.optimizer_params.find("amsgrad");
    return amsgrad != config.optimizer_params.end() && amsgrad->is_boolean() && amsgrad->get<bool>()
               ? StateKind::kAdamAmsgrad
               : StateKind::kAdam;
  }
  const auto momentum = config.optimizer_params.find("momentum");
  return momentum != config.optimizer_params.end() && momentum->get<double>() != 0
             ? StateKind::kSgdMomentum
             : StateKind::kSgd;
}

}  // namespace

bool has_auto_settings(const DeepSpeedConfig& config) {
  return config.stage_auto || config.offload_optimizer_auto || config.offload_param_auto;
}

std::string resolve_auto_configuration(DeepSpeedConfig& config, double num_params,
                                       double largest_unit_params, int64_t ranks_per_node,
                                       const AvailableMemory& available, bool needs_stage3,
                                       double activation_bytes) {
  if (!has_auto_settings(config)) {
    return "";
  }
  const OffloadOptions& optimizer_offload = config.zero.offload_optimizer();
  const OffloadOptions& param_offload = config.zero.offload_param();
  EstimateOptions options =
      EstimateOptions()
          .num_params(num_params)
          .largest_unit_params(largest_unit_params)
          // Hybrid sharding: the state is sharded over a shard group.
          .world_size(config.shard_group_size > 1 ? config.shard_group_size : config.world_size)
          .ranks_per_node(ranks_per_node)
          .activation_bytes(activation_bytes)
          .precision(config.fp16.enabled || config.bf16.enabled ? PrecisionRecipe::kMixed16
                                                                : PrecisionRecipe::kFp32)
          .optimizer(state_kind_of(config))
          .offload_ratio(optimizer_offload.ratio())
          .sub_group_size(static_cast<double>(config.zero.sub_group_size()))
          .nvme_buffer_count(optimizer_offload.buffer_count())
          .swap_gradients(optimizer_offload.swap_gradients())
          .param_max_in_cpu(static_cast<double>(param_offload.max_in_cpu()))
          .param_buffer_count(param_offload.buffer_count())
          .reduce_bucket_size(static_cast<double>(config.zero.reduce_bucket_size()))
          .max_buckets_in_flight(config.zero.max_buckets_in_flight())
          .prefetch_bucket_size(static_cast<double>(config.zero.stage3_prefetch_bucket_size()))
          .host_device(available.device_is_host && config.zero.gloo_reduce_scatter_all_to_all())
          .max_live_parameters(static_cast<double>(config.zero.stage3_max_live_parameters()))
          .reduce_in_fp32(config.zero.reduce_in_fp32());
  FixedSettings fixed;
  if (!config.stage_auto) {
    fixed.stage = config.zero_stage;
  } else if (needs_stage3) {
    fixed.stage = 3;
  }
  if (!config.offload_optimizer_auto) {
    fixed.offload_optimizer = config.offload_optimizer;
  }
  if (optimizer_offload.swap_gradients()) {
    fixed.min_stage = 2;  // stage 1 refuses it (nothing to swap: .grad is whole)
  }
  if (!config.offload_param_auto) {
    fixed.offload_param = config.offload_param;
  }
  // NVMe is a candidate only where its section says where to swap.
  fixed.optimizer_nvme = !optimizer_offload.nvme_path().empty();
  // ... and, for the parameters, where each bucket fits one swap buffer.
  fixed.param_nvme = !param_offload.nvme_path().empty() &&
                     std::ceil(largest_unit_params / static_cast<double>(config.world_size)) <=
                         static_cast<double>(param_offload.buffer_size());
  const Recommendation choice = choose_configuration(options, available, fixed);
  TORCH_CHECK_VALUE(choice.fits, "zeroshard \"auto\" configuration for ", num_params,
                    " parameters on ", config.world_size, " ranks: ", choice.reason);
  if (config.stage_auto) {
    config.zero_stage = choice.estimate.stage;
    config.zero.stage(choice.estimate.stage);
  }
  if (config.offload_optimizer_auto) {
    config.offload_optimizer = choice.offload_optimizer;
    config.zero.offload_optimizer(
        OffloadOptions(optimizer_offload).device(choice.offload_optimizer));
  }
  if (config.offload_param_auto) {
    config.offload_param = choice.offload_param;
    config.zero.offload_param(OffloadOptions(param_offload).device(choice.offload_param));
  }
  config.stage_auto = config.offload_optimizer_auto = config.offload_param_auto = false;
  return "zeroshard \"auto\" chose " + choice.reason;
}

}  // namespace zeroshard
