// ZeroOptimizer: what it holds, in bytes, where (the measurements behind
// optimizer_state_bytes(), gradient_bytes() and their host/device splits),
// and the cached buffers it can give back.
#include "zero_optimizer_impl.h"

#include <cstdint>

namespace zeroshard {

int64_t ZeroOptimizer::Impl::optimizer_state_bytes() const {
  return storage().bytes(StateTier::kDevice) + storage().bytes(StateTier::kHost);
}

int64_t ZeroOptimizer::Impl::device_model_state_bytes() const {
  int64_t bytes = gathered_parameter_bytes() + gradient_bytes();
  for (const auto& shard : buffers_) {
    if (shard.param_shard.defined() && placement_->parameter_tier() == StateTier::kDevice) {
      bytes += shard.param_shard.numel() * static_cast<int64_t>(shard.param_shard.element_size());
    }
  }
  return bytes + storage().bytes(StateTier::kDevice);
}

int64_t ZeroOptimizer::Impl::host_model_state_bytes() const {
  int64_t bytes = storage().bytes(StateTier::kHost);
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

int64_t ZeroOptimizer::Impl::gradient_shard_bytes(bool on_host) const {
  int64_t bytes = 0;
  for (size_t g = 0; g < buffers_.size(); ++g) {
    const at::Tensor& shard = buffers_[g].grad_shard;
    if (shard.defined() && placement_->gradient_shard_on_host(g) == on_host) {
      bytes += shard.numel() * static_cast<int64_t>(shard.element_size());
    }
  }
  return bytes;
}

int64_t ZeroOptimizer::Impl::gradient_bytes() const {
  int64_t bytes = buckets_->live_staging_bytes() + gradient_shard_bytes(/*on_host=*/false);
  for (const auto& group : param_groups_) {
    for (const auto& param : group.params()) {
      if (param.grad().defined()) {
        bytes += param.grad().numel() * static_cast<int64_t>(param.grad().element_size());
      }
    }
  }
  return bytes;
}

int64_t ZeroOptimizer::Impl::host_gradient_bytes() const {
  const NvmeGradientSwapper* swapper = gradient_swapper();
  return gradient_shard_bytes(/*on_host=*/true) + (swapper ? swapper->buffer_bytes() : 0);
}

int64_t ZeroOptimizer::Impl::cached_buffer_bytes() const {
  int64_t bytes = buckets_->cached_bytes() + stage1_grad_shard_pool_.cached_bytes();
  for (const Communicator* comm : groups_->communicators()) {
    bytes += comm->cached_bytes();
  }
  return bytes;
}

int64_t ZeroOptimizer::Impl::release_cached_buffers() {
  // What each pool unmapped, counted as it is unmapped: a buffer freed
  // between a count and the release would otherwise go uncounted.
  int64_t bytes = buckets_->release_cached_buffers() + stage1_grad_shard_pool_.clear();
  for (Communicator* comm : groups_->communicators()) {
    bytes += comm->release_cached_buffers();
  }
  return bytes;
}

}  // namespace zeroshard
