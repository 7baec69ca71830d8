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
  // They live where the shard's states do ([Note: parameter states]).
  const StateTier home = offloaded_ ? StateTier::kHost : StateTier::kDevice;
  return tier == home ? parameter_states_.bytes() : 0;
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
