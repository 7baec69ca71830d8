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

}  // namespace zeroshard
