// Run-time choice among the host kernel's per-capability variants (see
// csrc/offload/cpu/host_optimizer_kernel_impl.cpp).
#include "zeroshard/host_optimizer_kernel.h"

#include <ATen/Version.h>
#include <c10/util/Exception.h>

namespace zeroshard {
namespace host_kernels {
#define ZEROSHARD_DECLARE_HOST_KERNELS(capability) \
  namespace capability {                           \
  void adam_step(const HostAdamArgs& args);        \
  void sgd_step(const HostSgdArgs& args);          \
  }
ZEROSHARD_DECLARE_HOST_KERNELS(DEFAULT)
#if ZEROSHARD_HOST_KERNELS_X86
ZEROSHARD_DECLARE_HOST_KERNELS(AVX2)
ZEROSHARD_DECLARE_HOST_KERNELS(AVX512)
#endif
#undef ZEROSHARD_DECLARE_HOST_KERNELS
}  // namespace host_kernels

namespace {

// ATen's own choice: what the CPU supports, lowered by ATEN_CPU_CAPABILITY.
HostKernelVariant best_variant() {
  static const HostKernelVariant chosen = [] {
#if ZEROSHARD_HOST_KERNELS_X86
    const std::string name = at::get_cpu_capability();
    if (name.rfind("AVX512", 0) == 0) {
      return HostKernelVariant::kAVX512;
    }
    if (name.rfind("AVX2", 0) == 0) {
      return HostKernelVariant::kAVX2;
    }
#endif
    return HostKernelVariant::kDefault;
  }();
  return chosen;
}

HostKernelVariant resolve(HostKernelVariant variant) {
  if (variant == HostKernelVariant::kAuto) {
    return best_variant();
  }
  TORCH_CHECK_VALUE(host_kernel_variant_supported(variant),
                    "host kernel variant not available on this CPU (it supports up to ",
                    host_kernel_capability(), ")");
  return variant;
}

void check_common(int64_t numel, const float* param, const float* grad, const void* param_out,
                  c10::ScalarType out_dtype) {
  TORCH_CHECK_VALUE(numel >= 0, "host kernel: numel must be >= 0, got ", numel);
  TORCH_CHECK_VALUE(numel == 0 || (param != nullptr && grad != nullptr),
                    "host kernel: param and grad must be set");
  TORCH_CHECK_VALUE(
      param_out == nullptr || out_dtype == c10::ScalarType::Float ||
          out_dtype == c10::ScalarType::BFloat16 || out_dtype == c10::ScalarType::Half,
      "host kernel: the parameter copy must be float32, bfloat16 or float16, got ", out_dtype);
}

}  // namespace

bool host_kernel_variant_supported(HostKernelVariant variant) {
  return variant == HostKernelVariant::kAuto ||
         static_cast<int>(variant) <= static_cast<int>(best_variant());
}

HostKernelVariant parse_host_kernel_variant(const std::string& name) {
  if (name == "auto") {
    return HostKernelVariant::kAuto;
  }
  if (name == "DEFAULT") {
    return HostKernelVariant::kDefault;
  }
  if (name == "AVX2") {
    return HostKernelVariant::kAVX2;
  }
  if (name == "AVX512") {
    return HostKernelVariant::kAVX512;
  }
  TORCH_CHECK_VALUE(false, "unknown host kernel variant '", name,
                    "'; expected 'auto', 'DEFAULT', 'AVX2' or 'AVX512'");
}

void host_adam_step(const HostAdamArgs& args, HostKernelVariant variant) {
  check_common(args.numel, args.param, args.grad, args.param_out, args.out_dtype);
  TORCH_CHECK_VALUE(args.numel == 0 || (args.exp_avg != nullptr && args.exp_avg_sq != nullptr),
                    "host Adam: exp_avg and exp_avg_sq must be set");
  const HostKernelVariant chosen = resolve(variant);
  if (args.numel == 0) {
    return;
  }
  switch (chosen) {
#if ZEROSHARD_HOST_KERNELS_X86
    case HostKernelVariant::kAVX512:
      return host_kernels::AVX512::adam_step(args);
    case HostKernelVariant::kAVX2:
      return host_kernels::AVX2::adam_step(args);
#endif
    default:
      return host_kernels::DEFAULT::adam_step(args);
  }
}

void host_sgd_step(const HostSgdArgs& args, HostKernelVariant variant) {
  check_common(args.numel, args.param, args.grad, args.param_out, args.out_dtype);
  TORCH_CHECK_VALUE(args.numel == 0 || args.momentum == 0 || args.momentum_buffer != nullptr,
                    "host SGD: momentum != 0 needs a momentum buffer");
  const HostKernelVariant chosen = resolve(variant);
  if (args.numel == 0) {
    return;
  }
  switch (chosen) {
#if ZEROSHARD_HOST_KERNELS_X86
    case HostKernelVariant::kAVX512:
      return host_kernels::AVX512::sgd_step(args);
    case HostKernelVariant::kAVX2:
      return host_kernels::AVX2::sgd_step(args);
#endif
    default:
      return host_kernels::DEFAULT::sgd_step(args);
  }
}

std::string host_kernel_capability() {
  switch (best_variant()) {
    case HostKernelVariant::kAVX512:
      return "AVX512";
    case HostKernelVariant::kAVX2:
      return "AVX2";
    default:
      return "DEFAULT";
  }
}

}  // namespace zeroshard
