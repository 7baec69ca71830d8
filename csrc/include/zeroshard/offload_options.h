// Where the optimizer state and (stage 3) the parameter shards live when they
// do not stay on the training device: DeepSpeed's offload_optimizer and
// offload_param sections, in the LibTorch options style:
//   zeroshard::ZeroOptions().stage(3)
//       .offload_optimizer(zeroshard::OffloadOptions().device(zeroshard::OffloadDevice::kCPU))
//       .offload_param(zeroshard::OffloadOptions().device(zeroshard::OffloadDevice::kCPU));
// state_placement.h turns these into a decision per sub-group.
#pragma once

#include <torch/csrc/api/include/torch/arg.h>

#include <cstdint>
#include <string>

namespace zeroshard {

enum class OffloadDevice { kNone, kCPU, kNVMe };

// "none", "cpu", "nvme" in any case ("" is "none"); throws naming the choices.
OffloadDevice parse_offload_device(const std::string& name);
const char* offload_device_name(OffloadDevice device);

// DeepSpeed's buffer_count for an offload_param section that leaves it out
// (the config reader and the Python layer give it there; 4 is
// offload_optimizer's).
constexpr int64_t kOffloadParamBufferCount = 5;

struct OffloadOptions {
  TORCH_ARG(OffloadDevice, device) = OffloadDevice::kNone;
  // Host buffers in page-locked memory, so device copies run asynchronously
  // (CUDA only; ignored on a CPU device). On by default, the fast choice on a
  // GPU (DeepSpeed's default is false; pageable copies block the host).
  TORCH_ARG(bool, pin_memory) = true;
  // offload_optimizer only: the fraction of the sub-groups offloaded; the
  // first (1 - ratio) of them (rounded down) stay on the device.
  TORCH_ARG(double, ratio) = 1.0;
  // NVMe only (DeepSpeed's meaning; accepted and unused for "cpu"): I/O
  // buffers (offload_optimizer: sub-groups resident in host memory during the
  // step), their size (offload_param) and the parameter elements kept in CPU
  // memory (offload_param.max_in_cpu).
  TORCH_ARG(int64_t, buffer_count) = 4;  // offload_param: kOffloadParamBufferCount
  TORCH_ARG(int64_t, buffer_size) = 100000000;
  TORCH_ARG(int64_t, max_in_cpu) = 1000000000;
  TORCH_ARG(std::string, nvme_path) = "";
  // offload_optimizer on NVMe: read the next sub-groups while one updates,
  // and let its write drain during the next ones (see [Note: NVMe step
  // pipeline] in nvme_state_swapper.h). On by default, unlike DeepSpeed.
  TORCH_ARG(bool, pipeline_read) = true;
  TORCH_ARG(bool, pipeline_write) = true;
  // offload_optimizer on NVMe, stages 2 and 3, every sub-group offloaded:
  // the gradient shard goes to the swap file as it is reduced, and host
  // memory holds a few 4 MiB blocks of it instead of the whole shard (see
  // nvme_gradient_swapper.h). Costs 4 bytes a shard element of disk, and per
  // step a write of them per micro-batch, a read per accumulated micro-batch
  // after the first, a read for the step, and one more for clipping, the
  // overflow check (skip_nonfinite_steps) or hybrid replicas each. Off by
  // default: pick it where host memory binds before the disk does.
  TORCH_ARG(bool, swap_gradients) = false;

 public:
  bool enabled() const { return device_ != OffloadDevice::kNone; }
};

// [Note: one list of the offload keys]
// The keys of DeepSpeed's offload_optimizer and offload_param sections,
// once. X(name, sections, least, most): an OffloadOptions field read under
// its own name (its type and default are the TORCH_ARG's above), the sections
// that take it, and for numbers the range a config may give (most:
// kNoUpperBound for none). "device" is not listed: it is an enum, read as a
// name (and "auto" in a config). ZEROSHARD_OFFLOAD_IGNORED_KEYS lists
// DeepSpeed's keys accepted so that a DeepSpeed section can be passed
// unchanged, and not used: X(name, sections, value a config must hold:
// false for a flag, a fraction for cpuadam_cores_perc).
// The DeepSpeed config reader (config/offload_config.cpp), the Python
// binding (options_from_python.cpp: the dict into OffloadOptions and
// back) and python/zeroshard/offload.py (keys, defaults and types from
// zeroshard._C.offload_option_keys()) all read these lists; the aio section's
// list is ZEROSHARD_AIO_OPTIONS in io_engine.h.
enum OffloadSection : unsigned {
  kOffloadOptimizerSection = 1,
  kOffloadParamSection = 2,
  kOffloadBothSections = kOffloadOptimizerSection | kOffloadParamSection,
};
constexpr double kNoUpperBound = 1e300;

#define ZEROSHARD_OFFLOAD_OPTIONS(X)                      \
  X(nvme_path, kOffloadBothSections, 0, 0)                \
  X(buffer_count, kOffloadBothSections, 0, kNoUpperBound) \
  X(pin_memory, kOffloadBothSections, 0, 0)               \
  X(pipeline_read, kOffloadOptimizerSection, 0, 0)        \
  X(pipeline_write, kOffloadOptimizerSection, 0, 0)       \
  X(swap_gradients, kOffloadOptimizerSection, 0, 0)       \
  X(ratio, kOffloadOptimizerSection, 0, 1)                \
  X(buffer_size, kOffloadParamSection, 0, kNoUpperBound)  \
  X(max_in_cpu, kOffloadParamSection, 0, kNoUpperBound)

#define ZEROSHARD_OFFLOAD_IGNORED_KEYS(X)              \
  X(fast_init, kOffloadOptimizerSection, false)        \
  X(super_offload, kOffloadOptimizerSection, false)    \
  X(cpuadam_cores_perc, kOffloadOptimizerSection, 0.8) \
  X(convert_grad_on_cpu, kOffloadOptimizerSection, false)

// What the list above says of one key.
struct OffloadOptionInfo {
  const char* name;
  unsigned sections;  // OffloadSection bits
  double least;
  double most;
};

// Calls visit(info, value) for each listed OffloadOptions field, `value` a
// reference to the field (const when `options` is).
template <typename Options, typename Visitor>
void for_each_offload_option(Options& options, Visitor&& visit) {
#define ZEROSHARD_VISIT_OFFLOAD_OPTION(name, sections, least, most) \
  visit(OffloadOptionInfo{#name, sections, static_cast<double>(least), most}, options.name());
  ZEROSHARD_OFFLOAD_OPTIONS(ZEROSHARD_VISIT_OFFLOAD_OPTION)
#undef ZEROSHARD_VISIT_OFFLOAD_OPTION
}

// Calls visit(name, sections, value) for each ignored DeepSpeed key, `value`
// a bool (a flag) or a double (a fraction in [0, 1]).
template <typename Visitor>
void for_each_ignored_offload_key(Visitor&& visit) {
#define ZEROSHARD_VISIT_IGNORED_KEY(name, sections, value) \
  visit(#name, static_cast<unsigned>(sections), value);
  ZEROSHARD_OFFLOAD_IGNORED_KEYS(ZEROSHARD_VISIT_IGNORED_KEY)
#undef ZEROSHARD_VISIT_IGNORED_KEY
}

// A section's defaults: OffloadOptions' own, but offload_param's
// buffer_count is kOffloadParamBufferCount.
inline OffloadOptions offload_section_defaults(OffloadSection section) {
  OffloadOptions options;
  if (section == kOffloadParamSection) {
    options.buffer_count(kOffloadParamBufferCount);
  }
  return options;
}

}  // namespace zeroshard
