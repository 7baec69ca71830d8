// ZeroOptimizer: checks of options and parameters at construction, and the
// cross-rank agreement on the partition layout.
#include "zero_optimizer_impl.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cmath>
#include <unordered_map>

namespace zeroshard {

void validate_zero_options(const ZeroOptions& options, int64_t world_size) {
  TORCH_CHECK_VALUE(options.stage() >= 1 && options.stage() <= 3, "unsupported ZeRO stage ",
                    options.stage(),
                    "; zeroshard implements stage 1 (optimizer state sharding), stage 2 "
                    "(optimizer state and gradient sharding) and stage 3 (parameters too)");
  // The scalar options' ranges: [Note: one list of the scalar options].
  for_each_scalar_zero_option(options, [](const ZeroOptionInfo& info, const auto& value) {
    TORCH_CHECK_VALUE(*info.rule == '\0' || static_cast<double>(value) >= info.least, info.name,
                      " must be ", info.rule, ", got ", value);
  });
  check_aio_options(options.aio());
  const std::pair<const char*, const OffloadOptions*> offloads[] = {
      {"offload_optimizer", &options.offload_optimizer()},
      {"offload_param", &options.offload_param()}};
  for (const auto& [which, offload_ptr] : offloads) {
    const OffloadOptions& offload = *offload_ptr;
    const bool parameters = std::string(which) == "offload_param";
    TORCH_CHECK_VALUE(
        !parameters || offload.device() != OffloadDevice::kNVMe ||
            options.offload_optimizer().enabled(),
        "offload_param.device = 'nvme' needs offload_optimizer.device = 'cpu' or 'nvme': the "
        "step writes the new parameter shards to disk from the offloaded fp32 master (as in "
        "DeepSpeed's ZeRO-Infinity configurations, which offload both)");
    TORCH_CHECK_VALUE(offload.device() != OffloadDevice::kNVMe || !offload.nvme_path().empty(),
                      which,
                      ".device = 'nvme' needs nvme_path: a directory on the disk to swap to");
    TORCH_CHECK_VALUE(offload.ratio() >= 0 && offload.ratio() <= 1, which,
                      ".ratio must be in [0, 1] (the fraction of the optimizer state offloaded), "
                      "got ",
                      offload.ratio());
    TORCH_CHECK_VALUE(
        offload.buffer_count() >= 0 && offload.buffer_size() >= 0 && offload.max_in_cpu() >= 0,
        which, ": buffer_count, buffer_size and max_in_cpu must be >= 0");
  }
  TORCH_CHECK_VALUE(!options.offload_param().enabled() || options.stage() == 3,
                    "offload_param moves parameter shards and needs ZeRO stage 3 (as in "
                    "DeepSpeed); this optimizer has stage ",
                    options.stage(),
                    ". Use offload_optimizer to offload the optimizer state at stages 1 and 2");
  if (options.offload_optimizer().swap_gradients()) {
    const OffloadOptions& offload = options.offload_optimizer();
    TORCH_CHECK_VALUE(offload.device() == OffloadDevice::kNVMe,
                      "offload_optimizer.swap_gradients puts the gradient shard in the NVMe swap "
                      "space and needs offload_optimizer.device = 'nvme'; it is '",
                      offload_device_name(offload.device()), "'");
    TORCH_CHECK_VALUE(options.stage() >= 2,
                      "offload_optimizer.swap_gradients needs ZeRO stage 2 or 3: stage 1 keeps "
                      "every full gradient in .grad, so swapping its 1/N shard saves nothing; "
                      "this optimizer has stage ",
                      options.stage());
    TORCH_CHECK_VALUE(offload.ratio() == 1.0,
                      "offload_optimizer.swap_gradients needs ratio 1 (every sub-group on NVMe): "
                      "sub-groups updated on the device read the gradient shard there; ratio is ",
                      offload.ratio());
  }
  TORCH_CHECK_VALUE(options.offload_param().ratio() == 1.0,
                    "offload_param has no ratio (DeepSpeed's ratio is an offload_optimizer key)");
  TORCH_CHECK_VALUE(
      options.broadcast_from_rank() >= 0 && options.broadcast_from_rank() < world_size,
      "broadcast_from_rank must be a rank in [0, ", world_size, "), got ",
      options.broadcast_from_rank());
  TORCH_CHECK_VALUE(
      std::isfinite(options.gradient_divide_factor()) && options.gradient_divide_factor() >= 0,
      "gradient_divide_factor must be > 0 (or 0 for the data-parallel world size), "
      "got ",
      options.gradient_divide_factor());
}

void ZeroOptimizer::Impl::validate_parameters() const {
  TORCH_CHECK_VALUE(!param_groups_.empty(), "ZeroOptimizer got no parameter groups");
  std::unordered_map<const void*, std::pair<size_t, size_t>> seen;
  c10::optional<c10::Device> device;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    TORCH_CHECK_VALUE(!params.empty(), "parameter group ", g, " has no parameters");
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& param = params[i];
      TORCH_CHECK_VALUE(param.defined(), "parameter ", i, " of group ", g,
                        " is an undefined tensor");
      TORCH_CHECK_VALUE(param.is_leaf(), "parameter ", i, " of group ", g,
                        " is not a leaf tensor (it was computed from other tensors); "
                        "can't optimize a non-leaf Tensor: pass the leaf parameters");
      TORCH_CHECK_VALUE(param.layout() == c10::kStrided, "parameter ", i, " of group ", g,
                        " has layout ", param.layout(),
                        "; zeroshard supports dense (strided) parameters only");
      TORCH_CHECK_VALUE(at::isFloatingType(param.scalar_type()), "parameter ", i, " of group ", g,
                        " has dtype ", param.scalar_type(),
                        "; zeroshard expects floating-point parameters");
      TORCH_CHECK_VALUE(param.scalar_type() == params[0].scalar_type(), "parameter ", i,
                        " of group ", g, " has dtype ", param.scalar_type(),
                        " but parameter 0 of the group has ", params[0].scalar_type(),
                        "; all parameters of a group must share one dtype");
      if (!device) {
        device = param.device();
      }
      TORCH_CHECK_VALUE(param.device() == *device, "parameter ", i, " of group ", g, " is on ",
                        param.device(), " but the first parameter is on ", *device,
                        "; all parameters must be on one device");
      TORCH_CHECK_VALUE(param.is_meta() == param_groups_[0].params()[0].is_meta(), "parameter ", i,
                        " of group ", g,
                        " is on the meta device and others are not (or the reverse); build the "
                        "whole model on the meta device for partitioned construction");
      TORCH_CHECK_VALUE(!param.is_meta() || options_.stage() == 3, "parameter ", i, " of group ", g,
                        " is on the meta device; only stage 3 materializes meta parameters "
                        "(partitioned construction). Materialize the model or use stage=3");
      // A stage-3 optimizer releases gathered parameters by emptying their
      // storage; one destroyed while they were released leaves the model's
      // tensors with nothing behind them, and reading them would crash.
      int64_t extent = param.storage_offset() + 1;  // elements up to the last one
      for (int64_t d = 0; d < param.dim() && param.numel() > 0; ++d) {
        extent += (param.size(d) - 1) * param.stride(d);
      }
      const auto needed = static_cast<size_t>(extent) * param.element_size();
      TORCH_CHECK_VALUE(
          param.is_meta() || param.numel() == 0 || !param.has_storage() ||
              (param.storage().nbytes() >= needed && param.storage().data() != nullptr),
          "parameter ", i, " of group ", g, " (shape ", param.sizes(),
          ") has no values: its storage holds ", param.storage().nbytes(), " bytes, it needs ",
          needed,
          ". It is partitioned by a stage 3 ZeroOptimizer (one since destroyed, or another "
          "still holding this model); "
          "take the full values before dropping that optimizer (full_state_dict(), "
          "or load a checkpoint) and build the new one from a model holding them");
      auto [it, inserted] = seen.emplace(param.unsafeGetTensorImpl(), std::make_pair(g, i));
      TORCH_CHECK_VALUE(inserted, "some parameters appear more than once: parameter ", i,
                        " of group ", g, " is also parameter ", it->second.second, " of group ",
                        it->second.first, "; each parameter may belong to exactly one group, once");
    }
  }
}

void ZeroOptimizer::Impl::check_layout_agrees_across_ranks() {
  const int64_t fingerprint = layout_->fingerprint();
  at::Tensor extremes = at::tensor({fingerprint, -fingerprint}, at::kLong);
  groups_->shard().all_reduce_on_host(extremes, c10d::ReduceOp::MAX, "layout_check");
  groups_->max_across_replicas(extremes, "layout_check");
  const int64_t max_fp = extremes[0].item<int64_t>();
  const int64_t min_fp = -extremes[1].item<int64_t>();
  TORCH_CHECK(max_fp == fingerprint && min_fp == fingerprint,
              "ranks built different partition layouts (this rank's fingerprint ", fingerprint,
              ", smallest ", min_fp, ", largest ", max_fp,
              "): every rank must pass the same parameters, with the same shapes, in the "
              "same groups and order, and the same reduce_bucket_size");
}

}  // namespace zeroshard
