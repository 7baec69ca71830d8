// ZeroOptimizer: what it holds, in bytes, where (the measurements behind
// optimizer_state_bytes(), gradient_bytes() and their host/device splits),
// and the cached buffers it can give back.
#include "zero_optimizer_impl.h"

#include <cstdint>

namespace zeroshard {

int64_t ZeroOptimizer::Impl::optimizer_state_bytes() const {
  return storage().bytes(StateTier::kDevice) + storage().bytes(StateTier::kHost) +
         parameter_states_.bytes();
}

int64_t ZeroOptimizer::Impl::parameter_state_bytes(StateTier tier) const {
  // They live where their group's states do ([Note: parameter states]).
  int64_t bytes = 0;
  for (size_t g = 0; g < buffers_.size(); ++g) {
    bytes += state_tier(g) == tier ? parameter_states_.bytes(g) : 0;
  }
  return bytes;
}

StateTier ZeroOptimizer::Impl::state_tier(size_t g) const {
  if (!offloaded_) {
    return StateTier::kDevice;
  }
  // A rule's group is one sub-group ([Note: a rule on the host]); offload's
  // ratio may leave it on the device.
  const std::vector<SubGroup>& sub_groups = placement_->sub_groups(g);
  return sub_groups.empty() ? StateTier::kHost : sub_groups.front().tier;
}

int64_t ZeroOptimizer::Impl::device_model_state_bytes() const {
  int64_t bytes = gathered_parameter_bytes() + gradient_bytes();
  for (const auto& shard : buffers_) {
    if (shard.param_shard.defined() && placement_->parameter_tier() == StateTier::kDevice) {
      bytes += shard.param_shard.numel() * static_cast<int64_t>(shard.param_shard.element_size());
    }
  }
  return bytes + storage().bytes(StateTier::kDevice) + parameter_state_bytes(StateTier::kDevice);
}

int64_t ZeroOptimizer::Impl::host_model_state_bytes() const {
  int64_t bytes = storage().bytes(StateTier::kHost) + parameter_state_bytes(StateTier::kHost);
  if (param_swapper_) {
    bytes += param_swapper_->host_shard_bytes() + param_swapper_->ahead_bytes();
  }
  for (const auto& shard : buffers_) {
    if (shard.param_shard.defined() && placement_->parameter_tier() == StateTier::kHost) {
      bytes += shard.param_shard.numel() * static_cast<int64_t>(shard.param_shard.element_size());
    }
  }
  return bytes + host_gradient_bytes();
}

int64_t ZeroOptimizer::Impl::cached_buffer_bytes() const {
  int64_t bytes = gradients_->cached_bytes();
  for (const Communicator* comm : groups_->communicators()) {
    bytes += comm->cached_bytes();
  }
  return bytes;
}

int64_t ZeroOptimizer::Impl::release_cached_buffers() {
  // What each pool unmapped, counted as it is unmapped: a buffer freed
  // between a count and the release would otherwise go uncounted.
  int64_t bytes = gradients_->release_cached_buffers();
  for (Communicator* comm : groups_->communicators()) {
    bytes += comm->release_cached_buffers();
  }
  return bytes;
}

}  // namespace zeroshard
