#include "zeroshard/host_syncs.h"

namespace zeroshard {

const char* host_sync_name(HostSync reason) {
  switch (reason) {
    case HostSync::kStepFlags:
      return "step_flags";
    case HostSync::kClipCoefficient:
      return "clip_coefficient";
    case HostSync::kHostDataOnDevice:
      return "host_data_on_device";
    case HostSync::kOffloadGradientCopy:
      return "offload_gradient_copy";
    case HostSync::kOffloadUpdate:
      return "offload_update";
    case HostSync::kPageableCopy:
      return "pageable_copy";
    case HostSync::kTelemetry:
      return "telemetry";
    case HostSync::kCheckpoint:
      return "checkpoint";
  }
  return "unknown";
}

std::map<std::string, int64_t> HostSyncCounter::counts() const {
  std::map<std::string, int64_t> out;
  for (size_t r = 0; r < kHostSyncReasons; ++r) {
    const int64_t n = counts_[r].load(std::memory_order_relaxed);
    if (n > 0) {
      out[host_sync_name(static_cast<HostSync>(r))] = n;
    }
  }
  return out;
}

int64_t HostSyncCounter::total() const {
  int64_t sum = 0;
  for (const auto& n : counts_) {
    sum += n.load(std::memory_order_relaxed);
  }
  return sum;
}

at::Tensor read_to_host(const at::Tensor& tensor, HostSyncCounter* counter, HostSync reason) {
  if (counter != nullptr) {
    counter->count(reason);
  }
  return tensor.device().is_cpu() ? tensor : tensor.cpu();
}

}  // namespace zeroshard
