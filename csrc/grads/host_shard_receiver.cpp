#include "zeroshard/host_shard_receiver.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace zeroshard {

void HostShardReceiver::receive(const at::Tensor& target, const at::Tensor& reduced) {
  TORCH_INTERNAL_ASSERT(target.numel() == reduced.numel(), "slice lengths differ");
  if (reduced.device() == target.device()) {
    target.add_(reduced);
    return;
  }
  const c10::Device device = reduced.device();
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(device.type());
  // The collective's wait() ordered the current stream after it; the side
  // stream starts where the current one is now, so backward's next kernels
  // do not queue behind the transfer.
  c10::Event reduced_ready(device.type());
  reduced_ready.record(impl->getStream(device));
  const c10::Stream side = impl->getStreamFromGlobalPool(device);
  reduced_ready.block(side);
  // Copies already done are added now, so the end of the round finds
  // little left; past max_pending_, the oldest is waited for.
  while (!pending_.empty() &&
         (pending_.size() >= max_pending_ || pending_.front().copied.query())) {
    drain_oldest();
  }
  // Pinned whatever the shard is (pin_memory only says how the state is
  // held): a copy into pageable memory would block this hook, inside
  // backward, once per bucket. At most max_pending_ slices of it.
  Pending entry{c10::Event(device.type()),
                at::empty(reduced.sizes(), at::TensorOptions()
                                               .dtype(reduced.scalar_type())
                                               .device(target.device())
                                               .pinned_memory(true)),
                target};
  {
    c10::StreamGuard on_side(side);
    entry.staging.copy_(reduced, /*non_blocking=*/true);
  }
  entry.copied.record(side);
  // The device allocator keeps `reduced`'s block from reuse until the side
  // stream's copy is done, so the caller may release it now: no device
  // memory beyond the buckets in flight.
  impl->recordDataPtrOnStream(reduced.storage().data_ptr(), side);
  pending_.push_back(std::move(entry));
}

void HostShardReceiver::drain_oldest() {
  Pending& oldest = pending_.front();
  if (syncs_ != nullptr) {
    syncs_->count(HostSync::kOffloadGradientCopy);
  }
  oldest.copied.synchronize();
  oldest.target.add_(oldest.staging);
  pending_.pop_front();
}

void HostShardReceiver::drain() {
  while (!pending_.empty()) {
    drain_oldest();
  }
}

}  // namespace zeroshard
