// Host syncs, counted: every place zeroshard makes the host wait for the
// device goes through read_to_host() or HostSyncCounter::count(), by reason.
//
// [Note: host syncs, counted]
// On a GPU, a read of device memory by the host (.item(), .cpu(), a copy
// from pageable memory, an event or stream synchronize) blocks the host until
// the device has caught up, so the host can no longer queue work ahead of it:
// prefetches and overlapped collectives gain nothing after one. On CPU the
// same calls cost nothing, which is how a design that syncs per unit or per
// bucket passed every CPU test. So syncs are counted where they are made,
// whatever the device: a read of data that lives with the parameters (the
// "device", CPU included) counts; host knowledge (which units a rank wants,
// which parameters had a gradient, error strings) never touches the device
// and does not (see [Note: the host channel] in communicator.h). The count
// on a CPU run is therefore what the same run pays on a GPU, and tests hold
// a budget on it: after warm-up, at most 2 per step at every stage and none
// per unit or per bucket; with offload, one more per sub-group.
//
// Thread-safety: counts are atomic (gradient hooks run on autograd's
// threads).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <string>

namespace zeroshard {

// Why the host waited for the device.
enum class HostSync : uint8_t {
  // The step's one read: this rank's inf/NaN flag (skip_nonfinite_steps).
  kStepFlags,
  // Clipping's coefficient as a number, where the host applies it (offload).
  kClipCoefficient,
  // Host knowledge sent over a device-only group (no host channel): the
  // copy there and the read back.
  kHostDataOnDevice,
  // Waiting for a device-to-host copy of gradients (offload).
  kOffloadGradientCopy,
  // Waiting for the host's update before the device reads its result.
  kOffloadUpdate,
  // A copy between pageable host memory and the device.
  kPageableCopy,
  // The engine's loss, read for its telemetry line.
  kTelemetry,
  // Checkpoints, state dicts, full parameters: not in the step.
  kCheckpoint,
};
constexpr size_t kHostSyncReasons = static_cast<size_t>(HostSync::kCheckpoint) + 1;

// Its name in host_sync_counts(): "step_flags", "clip_coefficient", ...
const char* host_sync_name(HostSync reason);

class HostSyncCounter {
 public:
  void count(HostSync reason, int64_t times = 1) {
    counts_[static_cast<size_t>(reason)].fetch_add(times, std::memory_order_relaxed);
  }
  int64_t count_of(HostSync reason) const {
    return counts_[static_cast<size_t>(reason)].load(std::memory_order_relaxed);
  }
  // Every reason counted at least once, by name.
  std::map<std::string, int64_t> counts() const;
  int64_t total() const;

 private:
  std::array<std::atomic<int64_t>, kHostSyncReasons> counts_{};
};

// `tensor` on the host: a copy when it lives on a device (then the host
// waits for it), counted as one sync for `reason` whatever the device.
// `counter` may be null (components used on their own).
at::Tensor read_to_host(const at::Tensor& tensor, HostSyncCounter* counter, HostSync reason);

}  // namespace zeroshard
