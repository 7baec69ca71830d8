// Per-rank memory of model states under each ZeRO stage: the accounting of
// the ZeRO paper (Rajbhandari et al., 2020), matching what zeroshard
// allocates, plus DeepSpeed's own estimator formulas for comparison.
//
// Pure arithmetic: knows nothing of tensors, ranks or process groups.
#pragma once

#include "zeroshard/offload_options.h"
#include "zeroshard/zero_options.h"

#include <torch/csrc/api/include/torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard {

// kFp32: fp32 parameters and gradients (the master values are the
// parameters). kMixed16: 16-bit parameters and gradients, fp32 master copy.
enum class PrecisionRecipe { kFp32, kMixed16 };
// Which optimizer's states to count: Adam/AdamW (with or without amsgrad),
// SGD with or without momentum. How many fp32 states each keeps is
// inner_optimizer_states' answer (state_count), not the estimator's own.
enum class StateKind { kAdam, kAdamAmsgrad, kSgdMomentum, kSgd };

PrecisionRecipe parse_precision(const std::string& name);
StateKind parse_state_kind(const std::string& optimizer_name);
// fp32 states per parameter beside the master: 2, 3, 1 and 0.
int64_t state_count(StateKind optimizer);

struct EstimateOptions {
  TORCH_ARG(double, num_params) = 0;           // Ψ
  TORCH_ARG(double, largest_unit_params) = 0;  // parameters of the largest gathered unit
  TORCH_ARG(int64_t, world_size) = 1;          // N = DP x TP x PP ranks
  // Model parallel degrees (the seeds' 3D parallelism): each rank holds
  // 1/(TP x PP) of the model and ZeRO shards that over the N/(TP x PP)
  // data-parallel ranks; a unit (within one pipeline stage) is split TP ways.
  TORCH_ARG(int64_t, tensor_parallel_size) = 1;
  TORCH_ARG(int64_t, pipeline_parallel_size) = 1;
  // Activation memory per rank on the device (estimate_activation_bytes, or
  // measured), counted in device_bytes: model states alone say nothing of
  // whether a micro-batch fits.
  TORCH_ARG(double, activation_bytes) = 0;
  TORCH_ARG(int64_t, ranks_per_node) = 1;
  TORCH_ARG(PrecisionRecipe, precision) = PrecisionRecipe::kMixed16;
  TORCH_ARG(StateKind, optimizer) = StateKind::kAdam;
  // fp32 states per element beside the master, for an update rule of the
  // user's (update_rule.h: RAdam 2, Adagrad 1, NAdam 3; a fraction for
  // states of shapes of their own, Adafactor's (m + n) / (m * n) over a
  // model's matrices); -1 counts `optimizer`'s (state_count).
  TORCH_ARG(double, optimizer_states) = -1;
  TORCH_ARG(OffloadDevice, offload_optimizer) = OffloadDevice::kNone;
  TORCH_ARG(OffloadDevice, offload_param) = OffloadDevice::kNone;
  // The settings below default to the options' own defaults (ZeroOptions,
  // OffloadOptions), so an estimate without them is the one of a default
  // ZeroOptimizer, and a changed default changes it.
  // CPU optimizer offload as zeroshard runs it (see state_placement.h): the
  // fraction of sub-groups offloaded and their size, which sizes the host
  // staging buffers.
  TORCH_ARG(double, offload_ratio) = OffloadOptions().ratio();
  TORCH_ARG(double, sub_group_size) = static_cast<double>(ZeroOptions().sub_group_size());
  // NVMe optimizer offload: host buffers, each one sub-group's master and
  // moments (offload_optimizer.buffer_count).
  TORCH_ARG(int64_t,
            nvme_buffer_count) = offload_section_defaults(kOffloadOptimizerSection).buffer_count();
  // offload_optimizer.swap_gradients (applies with NVMe optimizer offload at
  // stages 2-3 and offload_ratio 1, ignored elsewhere): the fp32 gradient
  // shard on disk; host memory keeps buffer_count blocks of it
  // (nvme_gradient_swapper.h) instead of the shard.
  TORCH_ARG(bool, swap_gradients) = OffloadOptions().swap_gradients();
  // NVMe parameter offload (nvme_parameter_swapper.h): shard elements kept
  // in host memory (offload_param.max_in_cpu) and buckets read ahead, each
  // at most the largest unit's shard (offload_param.buffer_count).
  TORCH_ARG(double, param_max_in_cpu) =
      static_cast<double>(offload_section_defaults(kOffloadParamSection).max_in_cpu());
  TORCH_ARG(int64_t,
            param_buffer_count) = offload_section_defaults(kOffloadParamSection).buffer_count();
  // The buffers of the gradient reduction and of the stage 3 gathers, as
  // ZeroOptions sizes them (reduce_bucket_size, max_buckets_in_flight,
  // stage3_prefetch_bucket_size). On a CPU device (Gloo) each reduce-scatter
  // in flight also holds a receive buffer of its bucket's size (the
  // all-to-all that replaces Gloo's emulated reduce-scatter).
  TORCH_ARG(double, reduce_bucket_size) = static_cast<double>(ZeroOptions().reduce_bucket_size());
  TORCH_ARG(int64_t, max_buckets_in_flight) = ZeroOptions().max_buckets_in_flight();
  TORCH_ARG(double, prefetch_bucket_size) =
      static_cast<double>(ZeroOptions().stage3_prefetch_bucket_size());
  // host_device false also counts the pinned staging of gradient slices
  // bound for a host gradient shard (offload on an accelerator).
  TORCH_ARG(bool, host_device) = false;
  // Stage 3's stage3_max_live_parameters: the prefetch stops before the
  // gathered elements would pass it (parameter_gatherer.h).
  TORCH_ARG(double,
            max_live_parameters) = static_cast<double>(ZeroOptions().stage3_max_live_parameters());
  // Mixed precision with gradients reduced in fp32 (ZeroOptions'
  // reduce_in_fp32, DeepSpeed's communication_data_type "fp32"): the
  // buckets and the gradient shard are fp32; autograd's stage-0/1
  // gradients keep the parameters' dtype.
  TORCH_ARG(bool, reduce_in_fp32) = ZeroOptions().reduce_in_fp32();
};

// Bytes per rank unless named per node.
struct MemoryEstimate {
  int64_t stage = 0;
  double param_bytes = 0;      // on the device, between steps
  double grad_bytes = 0;       // on the device, after backward
  double optimizer_bytes = 0;  // on the device (fp32 master + states)
  // Stage 3: the units gathered at once, the largest and those prefetched
  // with it (16-bit or fp32 parameters).
  double working_bytes = 0;
  // Stages 1-3: the gradient buckets being filled and reduced
  // (max_buckets_in_flight + 1 of the largest, whose size is a unit at stage
  // 3 and reduce_bucket_size below), their reduced shards, and on a CPU
  // device the reduce-scatters' receive buffers.
  double staging_bytes = 0;
  // Stages 1-3, the step's fp32 transient on the device: a 16-bit gradient
  // updated on the device is widened to fp32 a chunk of kShardChunkElements
  // elements at a time (or the whole shard, if smaller); with partial
  // offload, a device sub-group's gradient is widened and scaled whole (two
  // fp32 copies, one for fp32 gradients). With every sub-group offloaded the
  // host kernel reads the gradient as it is: 0. Clipping a 16-bit gradient
  // holds one more chunk while its norm is taken, before the step: not
  // counted.
  double step_bytes = 0;
  double activation_bytes = 0;  // EstimateOptions::activation_bytes
  double device_bytes = 0;      // all of the above
  // Offloaded to CPU memory, all ranks of a node. For CPU optimizer offload:
  // the fp32 master (a copy of its own even for fp32 parameters) and moments
  // of the offloaded sub-groups, plus the staging buffers of the offloaded
  // step (the returning parameters, and the gradient in fp32 unless the step
  // reads a 'cpu' host shard in place, one or two sub-groups of each); with
  // every sub-group offloaded, the gradient shard at stages 2-3 (fp32 for
  // 'cpu', the reduced dtype for 'nvme'; grad_bytes is then 0) and, without
  // host_device, the pinned slices of the reductions in flight. For NVMe
  // optimizer offload: the staging buffers and buffer_count sub-groups'
  // master and moments; with swap_gradients, buffer_count 4 MiB gradient
  // blocks instead of the gradient shard, and the shard in fp32 on NVMe.
  // For NVMe parameter offload: the max_in_cpu elements' shards and the
  // read-ahead buffers.
  double cpu_bytes_per_node = 0;
  double nvme_bytes_per_node = 0;  // offloaded to NVMe, all ranks of a node
};

// The shape of a decoder-only transformer's training step, for its
// activation memory.
struct TransformerShape {
  TORCH_ARG(int64_t, layers) = 0;
  TORCH_ARG(int64_t, hidden) = 0;
  TORCH_ARG(int64_t, heads) = 0;
  TORCH_ARG(int64_t, vocab) = 0;
  TORCH_ARG(int64_t, sequence_length) = 0;
  TORCH_ARG(int64_t, micro_batch) = 0;
  // 2 for bf16/fp16 activations, 4 for fp32.
  TORCH_ARG(int64_t, bytes_per_value) = 2;
  // Activation checkpointing of every layer.
  TORCH_ARG(bool, checkpointing) = false;
  TORCH_ARG(int64_t, tensor_parallel_size) = 1;
};

// Bytes of activations a rank holds at the peak of one micro-batch's
// forward and backward. Per layer, Korthikanti et al. 2022 ("Reducing
// Activation Recomputation in Large Transformer Models", eq. 2, no sequence
// parallelism): s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes with 16-bit values and
// 1-byte dropout masks, the 2-byte terms doubled for fp32; with
// checkpointing, each layer's input (s*b*h values) plus one layer's full
// set. Plus the logits and their fp32 copy for the loss: s*b*V*(value + 4).
double estimate_activation_bytes(const TransformerShape& shape);

// Bytes per parameter of each model state under a recipe and optimizer.
struct StateBytes {
  double param = 0;      // 2 (16-bit) or 4 (fp32)
  double grad = 0;       // 2 or 4
  double optimizer = 0;  // K: 12 for mixed-precision Adam, 8 for fp32 Adam
};
StateBytes state_bytes_per_param(PrecisionRecipe precision, StateKind optimizer);
// The same for a rule keeping `states` fp32 states per element.
StateBytes state_bytes_per_param(PrecisionRecipe precision, double states);

// Throws for impossible combinations (e.g. parameter offload below stage 3).
MemoryEstimate estimate_memory(int64_t stage, const EstimateOptions& options);

// DeepSpeed's estimators (estimate_zero2_model_states_mem_needs and
// estimate_zero3_model_states_mem_needs), with their safety factor 1.5 on CPU.
struct DeepSpeedEstimate {
  double device_bytes = 0;
  double cpu_bytes = 0;  // per node
};
DeepSpeedEstimate deepspeed_estimate(int64_t stage, const EstimateOptions& options);

// The cheapest configuration that fits `device_bytes` per rank, tried in the
// order the ZeRO guides advise: stages 0, 1, 2, then 3, and offload (optimizer
// first, then parameters; CPU before NVMe) only when nothing else fits.
struct Recommendation {
  bool fits = false;
  MemoryEstimate estimate;
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  std::string reason;
};
Recommendation recommend_configuration(const EstimateOptions& options, double device_bytes);

// "ZeRO stage 3 + optimizer offload to nvme + parameter offload to cpu".
std::string describe_configuration(int64_t stage, OffloadDevice optimizer, OffloadDevice param);

// What a rank may plan for when a config says "auto": the memory and disk
// free, the minimum over the ranks (so that every rank decides alike).
struct AvailableMemory {
  double device_bytes = 0;      // per rank, on the training device (unused when device_is_host)
  double host_bytes = 0;        // per node: RAM the node's ranks share
  double nvme_bytes = -1;       // free at nvme_path; < 0: no nvme_path, NVMe is not tried
  bool device_is_host = false;  // a CPU device: the device memory is the host's RAM
};

// The settings a config fixes; the others (nullopt) are chosen.
struct FixedSettings {
  std::optional<int64_t> stage;
  std::optional<OffloadDevice> offload_optimizer;
  std::optional<OffloadDevice> offload_param;
  // The lowest stage a candidate may have (2 with swap_gradients, which
  // stage 1 refuses).
  int64_t min_stage = 1;
  // NVMe needs a swap path: false where the config's section gives none.
  bool optimizer_nvme = true;
  bool param_nvme = true;
};

// The cheapest configuration that fits in device, host and disk memory, in
// the order the seed documents advise: stages 1, 2, 3 without offload, then
// offload (CPU before NVMe, the optimizer state before the parameters). A
// candidate fits when the estimate's device bytes per rank fit the device,
// its host bytes per node fit the host (on a CPU device the two add up in
// the same RAM), and its NVMe bytes the disk. `reason` gives the figures of
// the choice and of what was rejected; when nothing fits it names what is
// short, and by how much, for the last (most offloaded) candidate.
Recommendation choose_configuration(const EstimateOptions& options,
                                    const AvailableMemory& available,
                                    const FixedSettings& fixed = {});

}  // namespace zeroshard
