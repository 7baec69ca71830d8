#include "zeroshard/memory_estimator.h"

#include "zeroshard/inner_optimizer.h"
#include "zeroshard/nvme_gradient_swapper.h"
#include "zeroshard/shard_chunk.h"
#include "zeroshard/state_placement.h"
#include "zeroshard/text.h"

#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace zeroshard {
namespace {

// DeepSpeed's additional_buffer_factor on CPU memory.
constexpr double kDeepSpeedCpuFactor = 1.5;

std::string gigabytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f GB", bytes / 1e9);
  return text;
}

}  // namespace

std::string describe_configuration(int64_t stage, OffloadDevice optimizer, OffloadDevice param) {
  std::string text = "ZeRO stage " + std::to_string(stage);
  if (optimizer != OffloadDevice::kNone) {
    text += " + optimizer offload to " + std::string(offload_device_name(optimizer));
  }
  if (param != OffloadDevice::kNone) {
    text += " + parameter offload to " + std::string(offload_device_name(param));
  }
  return text;
}

PrecisionRecipe parse_precision(const std::string& name) {
  const std::string key = lowercase(name);
  if (key == "fp32") {
    return PrecisionRecipe::kFp32;
  }
  if (key == "mixed16" || key == "fp16" || key == "bf16") {
    return PrecisionRecipe::kMixed16;
  }
  TORCH_CHECK_VALUE(false, "unknown precision recipe '", name,
                    "'; expected 'fp32' or 'mixed16' (16-bit parameters with fp32 master; "
                    "'fp16' and 'bf16' mean the same here)");
}

StateKind parse_state_kind(const std::string& optimizer_name) {
  const std::string key = lowercase(optimizer_name);
  if (key == "adam" || key == "adamw") {
    return StateKind::kAdam;
  }
  if (key == "adam_amsgrad" || key == "adamw_amsgrad" || key == "amsgrad") {
    return StateKind::kAdamAmsgrad;
  }
  if (key == "sgd_momentum" || key == "sgd-momentum" || key == "momentum") {
    return StateKind::kSgdMomentum;
  }
  if (key == "sgd") {
    return StateKind::kSgd;
  }
  TORCH_CHECK_VALUE(false, "unknown optimizer '", optimizer_name,
                    "'; expected 'adam', 'adamw', 'adam_amsgrad', 'sgd_momentum' or 'sgd'");
}

int64_t state_count(StateKind optimizer) {
  switch (optimizer) {
    case StateKind::kAdam:
      return optimizer_state_count(InnerOptimizerKind::kAdamW, torch::optim::AdamWOptions());
    case StateKind::kAdamAmsgrad:
      return optimizer_state_count(InnerOptimizerKind::kAdamW,
                                   torch::optim::AdamWOptions().amsgrad(true));
    case StateKind::kSgdMomentum:
      return optimizer_state_count(InnerOptimizerKind::kSGD,
                                   torch::optim::SGDOptions(1.0).momentum(0.9));
    case StateKind::kSgd:
      return optimizer_state_count(InnerOptimizerKind::kSGD, torch::optim::SGDOptions(1.0));
  }
  return 0;
}

StateBytes state_bytes_per_param(PrecisionRecipe precision, StateKind optimizer) {
  return state_bytes_per_param(precision, static_cast<double>(state_count(optimizer)));
}

StateBytes state_bytes_per_param(PrecisionRecipe precision, double states) {
  TORCH_CHECK_VALUE(states >= 0, "an optimizer keeps 0 or more states per element; got ", states);
  StateBytes bytes;
  if (precision == PrecisionRecipe::kMixed16) {
    bytes.param = 2;
    bytes.grad = 2;
    bytes.optimizer = 4 + 4 * states;  // fp32 master + fp32 states (K = 12 for Adam)
  } else {
    // The master values are the fp32 parameters (see [Note: fp32 master]).
    bytes.param = 4;
    bytes.grad = 4;
    bytes.optimizer = 4 * states;
  }
  return bytes;
}

double estimate_activation_bytes(const TransformerShape& shape) {
  for (int64_t value : {shape.layers(), shape.hidden(), shape.heads(), shape.sequence_length(),
                        shape.micro_batch(), shape.tensor_parallel_size()}) {
    TORCH_CHECK_VALUE(value >= 1,
                      "a transformer shape needs layers, hidden, heads, sequence_length, "
                      "micro_batch and tensor_parallel_size >= 1; got ",
                      value);
  }
  TORCH_CHECK_VALUE(shape.bytes_per_value() == 2 || shape.bytes_per_value() == 4,
                    "bytes_per_value must be 2 (16-bit) or 4 (fp32), got ",
                    shape.bytes_per_value());
  const double s = static_cast<double>(shape.sequence_length());
  const double b = static_cast<double>(shape.micro_batch());
  const double h = static_cast<double>(shape.hidden());
  const double a = static_cast<double>(shape.heads());
  const double t = static_cast<double>(shape.tensor_parallel_size());
  const double scale = static_cast<double>(shape.bytes_per_value()) / 2;
  // eq. 2: 10 sbh of which 2 sbh are dropout masks (1 byte: not scaled),
  // 24 sbh / t, and 5 a s^2 b / t (of which a s^2 b / t are masks).
  const double masks = s * b * h * 2 + a * s * s * b / t;
  const double values = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) - masks;
  const double layer = values * scale + masks;
  const double layers = static_cast<double>(shape.layers());
  const double stored =
      shape.checkpointing()
          ? layers * s * b * h * static_cast<double>(shape.bytes_per_value()) + layer
          : layers * layer;
  const double logits = s * b * static_cast<double>(shape.vocab()) / t *
                        static_cast<double>(shape.bytes_per_value() + 4);
  return stored + logits;
}

MemoryEstimate estimate_memory(int64_t stage, const EstimateOptions& options) {
  TORCH_CHECK_VALUE(stage >= 0 && stage <= 3, "ZeRO stage must be 0, 1, 2 or 3, got ", stage);
  TORCH_CHECK_VALUE(options.num_params() > 0, "the parameter count must be > 0, got ",
                    options.num_params());
  TORCH_CHECK_VALUE(options.world_size() >= 1, "world_size must be >= 1, got ",
                    options.world_size());
  TORCH_CHECK_VALUE(options.ranks_per_node() >= 1, "ranks_per_node must be >= 1, got ",
                    options.ranks_per_node());
  TORCH_CHECK_VALUE(options.offload_param() == OffloadDevice::kNone || stage == 3,
                    "parameter offload needs ZeRO stage 3 (parameters are sharded only "
                    "there); got stage ",
                    stage);
  TORCH_CHECK_VALUE(options.offload_optimizer() == OffloadDevice::kNone || stage >= 1,
                    "optimizer offload needs ZeRO stage 1, 2 or 3; got stage 0");
  const int64_t tp = options.tensor_parallel_size();
  const int64_t pp = options.pipeline_parallel_size();
  TORCH_CHECK_VALUE(tp >= 1 && pp >= 1,
                    "tensor_parallel_size and pipeline_parallel_size must be >= 1, got ", tp,
                    " and ", pp);
  TORCH_CHECK_VALUE(options.world_size() % (tp * pp) == 0, "world_size ", options.world_size(),
                    " must be a multiple of tensor_parallel_size x pipeline_parallel_size = ",
                    tp * pp, " (ranks = DP x TP x PP)");
  // This rank's slice of the model and the data-parallel ranks sharding it.
  const double psi = options.num_params() / static_cast<double>(tp * pp);
  const double n = static_cast<double>(options.world_size() / (tp * pp));
  const double largest = options.largest_unit_params() / static_cast<double>(tp);
  const StateBytes per =
      options.optimizer_states() >= 0
          ? state_bytes_per_param(options.precision(), options.optimizer_states())
          : state_bytes_per_param(options.precision(), options.optimizer());

  // The buckets' and the gradient shard's bytes per element.
  const double reduced =
      options.reduce_in_fp32() && options.precision() == PrecisionRecipe::kMixed16 ? 4 : per.grad;

  MemoryEstimate estimate;
  estimate.stage = stage;
  estimate.param_bytes = per.param * psi / (stage >= 3 ? n : 1);
  estimate.grad_bytes = stage >= 2 ? reduced * psi / n : per.grad * psi;
  estimate.optimizer_bytes = per.optimizer * psi / (stage >= 1 ? n : 1);
  if (stage == 3 && largest > 0) {
    TORCH_CHECK_VALUE(options.max_live_parameters() >= 0, "max_live_parameters must be >= 0, got ",
                      options.max_live_parameters());
    // The gatherer prefetches whole units while they fit in the prefetch
    // window and the gathered total stays within max_live_parameters: with
    // units of the largest size, floor(window / largest) of them, or
    // floor((max_live - largest) / largest) beside the unit in use, and
    // never more than the rest of the model.
    const double by_window = std::floor(options.prefetch_bucket_size() / largest);
    const double by_live =
        std::floor(std::max(0.0, options.max_live_parameters() - largest) / largest);
    const double prefetched =
        std::min(std::min(by_window, by_live) * largest, std::max(0.0, psi - largest));
    estimate.working_bytes = per.param * (largest + prefetched);
  }
  // A unit is never split across buckets; other parameters are cut by size.
  const double bucket =
      std::max(stage == 3 ? largest : 0.0, std::min(options.reduce_bucket_size(), psi));
  const double in_flight = static_cast<double>(options.max_buckets_in_flight());
  if (stage >= 1) {
    TORCH_CHECK_VALUE(options.reduce_bucket_size() >= 1 && options.max_buckets_in_flight() >= 1,
                      "reduce_bucket_size and max_buckets_in_flight must be >= 1, got ",
                      options.reduce_bucket_size(), " and ", options.max_buckets_in_flight());
    const double receive = options.host_device() ? in_flight * bucket : 0;
    estimate.staging_bytes =
        reduced * ((in_flight + 1) * bucket + in_flight * bucket / n + receive);
    // ZeroOptimizer's update (zero_optimizer_update.cpp) widens a 16-bit
    // gradient a chunk at a time; with offload, see the device sub-groups below.
    if (options.offload_optimizer() == OffloadDevice::kNone && reduced < 4) {
      estimate.step_bytes = 4 * std::min(static_cast<double>(kShardChunkElements), psi / n);
    }
  }
  auto offload = [&](OffloadDevice device, double& bytes) {
    const double per_node = bytes * static_cast<double>(options.ranks_per_node());
    if (device == OffloadDevice::kCPU) {
      estimate.cpu_bytes_per_node += per_node;
      bytes = 0;
    } else if (device == OffloadDevice::kNVMe) {
      estimate.nvme_bytes_per_node += per_node;
      bytes = 0;
    }
  };
  if (options.offload_optimizer() != OffloadDevice::kNone && stage >= 1) {
    // What OffloadedOptimizerState allocates for one parameter group.
    TORCH_CHECK_VALUE(options.offload_ratio() >= 0 && options.offload_ratio() <= 1,
                      "offload_ratio must be in [0, 1], got ", options.offload_ratio());
    TORCH_CHECK_VALUE(options.sub_group_size() >= 1, "sub_group_size must be >= 1, got ",
                      options.sub_group_size());
    const double shard = psi / n;
    const double states =
        per.optimizer - (options.precision() == PrecisionRecipe::kMixed16 ? 4 : 0);
    const double sub = options.sub_group_size();
    // Sub-groups are full-sized but the last; the first (1 - ratio) stay.
    const double sub_groups = std::ceil(shard / sub);
    const auto on_device = static_cast<double>(StatePlacement::device_sub_group_count(
        static_cast<int64_t>(sub_groups), options.offload_ratio()));
    const double device_elements = std::min(shard, on_device * sub);
    const double host_elements = shard - device_elements;
    const double host_groups = sub_groups - on_device;
    const double largest_host = host_groups > 1 ? sub : host_elements;
    const double per_element = 4 + states;  // fp32 master + moments
    // The offloaded step's device sub-groups (offloaded_optimizer_state.cpp)
    // widen (16-bit) and scale their gradient whole, one sub-group at a time.
    estimate.step_bytes = (reduced < 4 ? 8 : 4) * std::min(device_elements, sub);
    // With every sub-group offloaded the gradient shard lives on the host
    // (StatePlacement::gradient_shard_options): in fp32 for 'cpu', read in
    // place by the step; as reduced for 'nvme'. Gradients not read in place
    // are staged in two fp32 buffers.
    const bool nvme = options.offload_optimizer() == OffloadDevice::kNVMe;
    const bool grads_on_host = on_device == 0 && host_groups > 0;
    const bool in_place = grads_on_host && !nvme;
    const double nvme_buffer_count =
        static_cast<double>(std::max<int64_t>(1, options.nvme_buffer_count()));
    // Where ZeroOptimizer would swap them (NVMe, stages 2-3, ratio 1);
    // ignored elsewhere, as parameter offload is below stage 3.
    const bool swapped = options.swap_gradients() && nvme && stage >= 2 && grads_on_host &&
                         options.offload_ratio() == 1.0;
    // Swapped gradients are read into staging with an aligned margin on each
    // side (NvmeGradientSwapper::read_capacity).
    const double margin = swapped ? NvmeGradientSwapper::read_capacity(0) * 4 : 0.0;
    const double staging =
        std::min(2.0, host_groups) * (largest_host * ((in_place ? 0 : 4) + per.param) + margin);
    estimate.optimizer_bytes = per_element * device_elements;
    const double ranks = static_cast<double>(options.ranks_per_node());
    // Stage 1's shard is a transient of step() (or lives from backward to
    // step() with stage1_reduce_in_backward): not counted, as on the device
    // without offload, where a CPU device's pool (or CUDA's caching
    // allocator) keeps its memory between steps as cache
    // (cached_buffer_bytes(), [Note: the stage-1 shard between steps]).
    if (swapped) {
      // NvmeGradientSwapper: the fp32 shard on disk; between steps its pool
      // keeps at most buffer_count blocks (rounding to 4 KiB ignored).
      const auto block = static_cast<double>(kGradientSwapBlockElements);
      estimate.grad_bytes = 0;
      estimate.nvme_bytes_per_node += 4 * shard * ranks;
      estimate.cpu_bytes_per_node += std::min(nvme_buffer_count, std::ceil(shard / block)) *
                                     std::min(block, shard) * 4 * ranks;
    } else if (grads_on_host && stage >= 2) {
      estimate.grad_bytes = 0;
      estimate.cpu_bytes_per_node += (in_place ? 4 : reduced) * shard * ranks;
      if (!options.host_device()) {
        // HostShardReceiver's pinned staging on an accelerator: a reduced
        // bucket slice per collective in flight.
        estimate.cpu_bytes_per_node += in_flight * bucket / n * reduced * ranks;
      }
    }
    if (nvme) {
      // NvmeStateSwapper: the state on disk, buffer_count sub-groups of it in
      // host buffers (slots rounded up to 4 KiB there and on disk: ignored).
      const double buffers = std::min(nvme_buffer_count, host_groups) * largest_host * per_element;
      estimate.nvme_bytes_per_node += per_element * host_elements * ranks;
      estimate.cpu_bytes_per_node += (buffers + staging) * ranks;
    } else {
      estimate.cpu_bytes_per_node += (per_element * host_elements + staging) * ranks;
    }
  } else {
    offload(options.offload_optimizer(), estimate.optimizer_bytes);
  }
  if (options.offload_param() == OffloadDevice::kNVMe && stage == 3) {
    // NvmeParameterSwapper: the first max_in_cpu elements in host memory, the
    // rest on disk, buffer_count buckets of at most a unit's shard read ahead
    // (slots rounded up to 4 KiB: ignored).
    const double ranks = static_cast<double>(options.ranks_per_node());
    const double shard = psi / n;
    const double in_cpu = std::min(shard, std::max(0.0, options.param_max_in_cpu()));
    const double ahead = static_cast<double>(std::max<int64_t>(1, options.param_buffer_count())) *
                         std::ceil(largest / n);
    estimate.cpu_bytes_per_node += (in_cpu + (in_cpu < shard ? ahead : 0.0)) * per.param * ranks;
    estimate.nvme_bytes_per_node += (shard - in_cpu) * per.param * ranks;
    estimate.param_bytes = 0;
  } else {
    offload(options.offload_param(), estimate.param_bytes);
  }
  TORCH_CHECK_VALUE(options.activation_bytes() >= 0, "activation_bytes must be >= 0, got ",
                    options.activation_bytes());
  estimate.activation_bytes = options.activation_bytes();
  estimate.device_bytes = estimate.activation_bytes + estimate.param_bytes + estimate.grad_bytes +
                          estimate.optimizer_bytes + estimate.working_bytes +
                          estimate.staging_bytes + estimate.step_bytes;
  return estimate;
}

DeepSpeedEstimate deepspeed_estimate(int64_t stage, const EstimateOptions& options) {
  TORCH_CHECK_VALUE(stage == 2 || stage == 3,
                    "DeepSpeed publishes estimators for stages 2 and 3 only; got stage ", stage);
  const double p = options.num_params();
  const double n = static_cast<double>(options.world_size());
  const double g = static_cast<double>(options.ranks_per_node());
  const double nodes = std::max(1.0, n / g);
  const double largest = 4 * options.largest_unit_params();
  const bool offload_optimizer = options.offload_optimizer() != OffloadDevice::kNone;
  const bool offload_param = options.offload_param() != OffloadDevice::kNone;
  DeepSpeedEstimate out;
  if (stage == 2) {
    if (offload_optimizer) {
      out.device_bytes = 2 * p;
      out.cpu_bytes = p * std::max(4 * n, 16.0) * kDeepSpeedCpuFactor;
    } else {
      out.device_bytes = 2 * p + 18 * p / n;
      out.cpu_bytes = 4 * p * g * kDeepSpeedCpuFactor;
    }
    return out;
  }
  // Stage 3, with the model built partitioned (zero_init).
  if (offload_param) {
    out.device_bytes = largest;
    out.cpu_bytes = p * 18 / nodes * kDeepSpeedCpuFactor;
  } else if (offload_optimizer) {
    out.device_bytes = largest + 2 * p / n;
    out.cpu_bytes = p * 16 / nodes * kDeepSpeedCpuFactor;
  } else {
    out.device_bytes = largest + 18 * p / n;
    out.cpu_bytes = options.largest_unit_params() * 4 * g * kDeepSpeedCpuFactor;
  }
  return out;
}

Recommendation recommend_configuration(const EstimateOptions& options, double device_bytes) {
  TORCH_CHECK_VALUE(device_bytes > 0, "device memory must be > 0 bytes, got ", device_bytes);
  struct Candidate {
    int64_t stage;
    OffloadDevice optimizer;
    OffloadDevice param;
  };
  const OffloadDevice none = OffloadDevice::kNone, cpu = OffloadDevice::kCPU,
                      nvme = OffloadDevice::kNVMe;
  const Candidate candidates[] = {{0, none, none}, {1, none, none}, {2, none, none},
                                  {3, none, none}, {2, cpu, none},  {3, cpu, none},
                                  {3, cpu, cpu},   {3, nvme, cpu},  {3, nvme, nvme}};
  Recommendation best;
  std::string previous;
  for (const auto& candidate : candidates) {
    EstimateOptions tried = options;
    tried.offload_optimizer(candidate.optimizer).offload_param(candidate.param);
    const MemoryEstimate estimate = estimate_memory(candidate.stage, tried);
    const std::string name =
        describe_configuration(candidate.stage, candidate.optimizer, candidate.param);
    if (estimate.device_bytes <= device_bytes) {
      best.fits = true;
      best.estimate = estimate;
      best.offload_optimizer = candidate.optimizer;
      best.offload_param = candidate.param;
      best.reason = name + " is the first configuration that fits: it needs " +
                    gigabytes(estimate.device_bytes) + " of " + gigabytes(device_bytes) +
                    " per rank" + (previous.empty() ? std::string(".") : "; " + previous + ".") +
                    " Lower stages communicate less and offload is slowest, so they are "
                    "tried first.";
      return best;
    }
    previous = name + " would need " + gigabytes(estimate.device_bytes);
    best.estimate = estimate;
  }
  best.reason = "nothing fits in " + gigabytes(device_bytes) + " per rank: even " + previous +
                "; add ranks or memory";
  return best;
}

}  // namespace zeroshard
