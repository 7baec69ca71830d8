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

enum class Capability { kDefault, kAvx2, kAvx512 };

Capability capability() {
  // ATen's own choice: what the CPU supports, lowered by ATEN_CPU_CAPABILITY.
  static const Capability chosen = [] {
#if ZEROSHARD_HOST_KERNELS_X86
    const std::string name = at::get_cpu_capability();
    if (name.rfind("AVX512", 0) == 0) {
      return Capability::kAvx512;
    }
    if (name.rfind("AVX2", 0) == 0) {
      return Capability::kAvx2;
    }
#endif
    return Capability::kDefault;
  }();
  return chosen;
}

void check_common(int64_t numel, const float* param, const float* grad, const void* param_out,
                  c10::ScalarType out_dtype) {
  TORCH_CHECK_VALUE(numel >= 0, "host kernel: numel must be >= 0, got ", numel);
  TORCH_CHECK_VALUE(numel == 0 || (param != nullptr && grad != nullptr),
                    "host kernel: param and grad must be set");
  TORCH_CHECK_VALUE(param_out == nullptr || out_dtype == c10::ScalarType::Float ||
                        out_dtype == c10::ScalarType::BFloat16 ||
                        out_dtype == c10::ScalarType::Half,
                    "host kernel: the parameter copy must be float32, bfloat16 or float16, got ",
                    out_dtype);
}

}  // namespace

void host_adam_step(const HostAdamArgs& args) {
  check_common(args.numel, args.param, args.grad, args.param_out, args.out_dtype);
  TORCH_CHECK_VALUE(args.numel == 0 || (args.exp_avg != nullptr && args.exp_avg_sq != nullptr),
                    "host Adam: exp_avg and exp_avg_sq must be set");
  if (args.numel == 0) {
    return;
  }
  switch (capability()) {
#if ZEROSHARD_HOST_KERNELS_X86
    case Capability::kAvx512:
      return host_kernels::AVX512::adam_step(args);
    case Capability::kAvx2:
      return host_kernels::AVX2::adam_step(args);
#endif
    default:
      return host_kernels::DEFAULT::adam_step(args);
  }
}

void host_sgd_step(const HostSgdArgs& args) {
  check_common(args.numel, args.param, args.grad, args.param_out, args.out_dtype);
  TORCH_CHECK_VALUE(args.numel == 0 || args.momentum == 0 || args.momentum_buffer != nullptr,
                    "host SGD: momentum != 0 needs a momentum buffer");
  if (args.numel == 0) {
    return;
  }
  switch (capability()) {
#if ZEROSHARD_HOST_KERNELS_X86
    case Capability::kAvx512:
      return host_kernels::AVX512::sgd_step(args);
    case Capability::kAvx2:
      return host_kernels::AVX2::sgd_step(args);
#endif
    default:
      return host_kernels::DEFAULT::sgd_step(args);
  }
}

std::string host_kernel_capability() {
  switch (capability()) {
    case Capability::kAvx512:
      return "AVX512";
    case Capability::kAvx2:
      return "AVX2";
    default:
      return "DEFAULT";
  }
}

}  // namespace zeroshard
