// Reduced bucket slices bound for a gradient shard in host memory (CPU
// offload of the optimizer: see [Note: gradients to the host] in
// offloaded_optimizer_state.h).
//
// On an accelerator each slice leaves the device as soon as its collective is
// waited on: a non-blocking copy on a side stream into pinned staging (at
// most `max_pending` slices of it), so the transfer overlaps the rest of
// backward, then an add into the shard when the slice is drained. The
// device buffer is recorded on the side stream and may be released at once.
// On a CPU device the slice is added at once.
//
// Thread-safety: none; GradientBuckets' caller serialises access.
#pragma once

#include "zeroshard/host_syncs.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <cstddef>
#include <deque>

namespace zeroshard {

class HostShardReceiver {
 public:
  // At most `max_pending` (>= 1) copies in flight: the oldest is drained
  // first. Each wait for a copy counts in `syncs` (may be null).
  explicit HostShardReceiver(size_t max_pending, HostSyncCounter* syncs = nullptr)
      : max_pending_(max_pending), syncs_(syncs) {}

  // Adds `reduced` (a device tensor, any floating dtype) into `target` (a host
  // slice of the same length), now or when drained.
  void receive(const at::Tensor& target, const at::Tensor& reduced);

  // Waits for every copy in flight and adds it into its target.
  void drain();

  size_t pending() const { return pending_.size(); }

 private:
  struct Pending {
    c10::Event copied;
    at::Tensor staging;  // host, pinned, reduced's dtype
    at::Tensor target;
  };
  void drain_oldest();

  size_t max_pending_;
  HostSyncCounter* syncs_;
  std::deque<Pending> pending_;
};

}  // namespace zeroshard
