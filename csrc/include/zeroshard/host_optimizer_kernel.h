// The host optimizer kernel: one fused pass over a contiguous run of fp32
// optimizer state in host memory (the offload step, see docs/design.md
// "Offload").
//
// One pass reads the gradient, folds in a gradient scale (1 / (world size x
// loss scale) times the clipping coefficient), updates the fp32 master value
// and the moments, and writes the parameter copy the device gets back (fp32,
// bf16 or fp16, rounded to nearest even). 28 bytes of memory traffic per
// element for Adam with fp32 parameters; DeepSpeed's CPU Adam with a separate
// unscale and copy-back makes three passes (~42).
//
// Vectorized with ATen's at::vec::Vectorized and compiled once per CPU
// capability (DEFAULT, AVX2, AVX512); the variant is chosen at run time the
// way ATen chooses its own (at::get_cpu_capability(), which honours the
// ATEN_CPU_CAPABILITY environment variable). Multi-threaded with
// at::parallel_for, so torch.set_num_threads governs it.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace zeroshard {

struct HostAdamArgs {
  float* param = nullptr;       // fp32 master values, updated in place
  const float* grad = nullptr;  // fp32 gradient (before grad_scale)
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // amsgrad only, else null
  // Where the updated parameter is written in the parameters' dtype; null
  // writes nothing. out_dtype: kFloat, kBFloat16 or kHalf.
  void* param_out = nullptr;
  c10::ScalarType out_dtype = c10::ScalarType::Float;
  int64_t numel = 0;
  float grad_scale = 1.0f;
  // The hyper-parameters: host_adam_args fills them from the options (whose
  // defaults are torch.optim's, inner_optimizer.h); no second set of defaults.
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled_weight_decay = true;  // AdamW; false: Adam's L2 term
  int64_t step = 1;                    // after incrementing: 1 on the first update
};

struct HostSgdArgs {
  float* param = nullptr;
  const float* grad = nullptr;
  float* momentum_buffer = nullptr;  // null when momentum == 0
  void* param_out = nullptr;
  c10::ScalarType out_dtype = c10::ScalarType::Float;
  int64_t numel = 0;
  float grad_scale = 1.0f;
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;  // from host_sgd_args
  bool nesterov = false;
  int64_t step = 1;  // 1: the momentum buffer starts as the gradient (torch.optim)
};

// kAuto: the variant ATen would pick on this CPU. An explicit variant (tests,
// benchmarks) must be one this CPU supports: host_kernel_variant_supported.
enum class HostKernelVariant { kAuto, kDefault, kAVX2, kAVX512 };

void host_adam_step(const HostAdamArgs& args, HostKernelVariant variant = HostKernelVariant::kAuto);
void host_sgd_step(const HostSgdArgs& args, HostKernelVariant variant = HostKernelVariant::kAuto);

bool host_kernel_variant_supported(HostKernelVariant variant);
// The variant kAuto runs here: "DEFAULT", "AVX2" or "AVX512".
std::string host_kernel_capability();
// "DEFAULT", "AVX2", "AVX512" -> variant; throws naming the choices.
HostKernelVariant parse_host_kernel_variant(const std::string& name);

}  // namespace zeroshard
