// ZeroOptimizer: where the master values live and how they are read and
// written, at every stage and placement. The placement decision is
// state_placement.h's, the offloaded state and step are
// offloaded_optimizer_state.h's; here they meet the shards and parameters.
#include "zero_optimizer_impl.h"

#include "zeroshard/shard_chunk.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard {

// [Note: fp32 master]
// Mixed-precision ZeRO keeps an fp32 master copy of each rank's shard. When
// the parameters already are fp32 that copy would duplicate values the rank
// holds anyway, so the master values are this rank's slices of the flat
// parameter buffer: the inner optimizer updates them in place and the
// all-gather sends them on. Adam's per-rank state is then 8 bytes per owned
// element instead of 12, the ZeRO paper's fp32 figure.
at::TensorOptions ZeroOptimizer::Impl::fp32_options() const {
  return shards_[0].param_options.dtype(at::kFloat);
}

at::Tensor ZeroOptimizer::Impl::master_slice(size_t g, const Bucket& bucket) {
  TORCH_INTERNAL_ASSERT(!offloaded_, "master_slice: offloaded masters have no device view");
  GroupShards& shard = shards_[g];
  if (shard.master.defined()) {
    return shard.master.narrow(0, bucket.shard_offset, bucket.shard_numel);
  }
  if (shard.param_shard.defined()) {  // stage 3, fp32
    return shard.param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel);
  }
  return shard.flat_param.narrow(0, layout_->group(g).rank_slice_offset(bucket, comm_->rank()),
                                 bucket.shard_numel);
}

at::Tensor ZeroOptimizer::Impl::master_shard(size_t g) const {
  const GroupShards& shard = shards_[g];
  if (offloaded_ && offloaded_->has(g, OptimizerStateName::kMaster)) {
    return offloaded_->read(g, OptimizerStateName::kMaster, 0, layout_->group(g).shard_numel(),
                            fp32_options());
  }
  if (shard.master.defined()) {
    return shard.master.detach().clone();
  }
  if (shard.param_shard.defined()) {  // stage 3, fp32
    return shard.param_shard.detach().clone();
  }
  const GroupLayout& layout = layout_->group(g);
  at::Tensor out = at::empty({layout.shard_numel()}, fp32_options());
  for (const auto& bucket : layout.buckets()) {
    out.narrow(0, bucket.shard_offset, bucket.shard_numel)
        .copy_(shard.flat_param.narrow(0, layout.rank_slice_offset(bucket, comm_->rank()),
                                       bucket.shard_numel));
  }
  return out;
}

void ZeroOptimizer::Impl::set_master_shard(size_t g, const at::Tensor& values) {
  write_master(g, 0, values);
}

at::Tensor ZeroOptimizer::Impl::read_master(size_t g, int64_t offset, int64_t length) const {
  if (offloaded_) {
    return offloaded_->read(g, OptimizerStateName::kMaster, offset, length, fp32_options());
  }
  const GroupShards& shard = shards_[g];
  if (shard.master.defined()) {
    return shard.master.narrow(0, offset, length).clone();
  }
  if (shard.param_shard.defined()) {  // stage 3, fp32: the shard is the master
    return shard.param_shard.narrow(0, offset, length).clone();
  }
  // Stages 1-2, fp32: this rank's slice of flat_param, when the range lies in
  // one bucket (what full_parameters asks); a whole-shard copy otherwise.
  const GroupLayout& layout = layout_->group(g);
  for (const auto& bucket : layout.buckets()) {
    if (offset >= bucket.shard_offset &&
        offset + length <= bucket.shard_offset + bucket.shard_numel) {
      return shard.flat_param
          .narrow(0, layout.rank_slice_offset(bucket, comm_->rank()) + offset - bucket.shard_offset,
                  length)
          .clone();
    }
  }
  return master_shard(g).narrow(0, offset, length);
}

void ZeroOptimizer::Impl::write_master(size_t g, int64_t offset, const at::Tensor& values) {
  if (offloaded_) {
    offloaded_->write(g, OptimizerStateName::kMaster, offset, values.to(at::kFloat));
    return;
  }
  for (const auto& bucket : layout_->group(g).buckets()) {
    const int64_t begin = std::max(offset, bucket.shard_offset);
    const int64_t end = std::min(offset + values.numel(), bucket.shard_offset + bucket.shard_numel);
    if (begin < end) {
      master_slice(g, bucket)
          .narrow(0, begin - bucket.shard_offset, end - begin)
          .copy_(values.narrow(0, begin - offset, end - begin));
    }
  }
}

void ZeroOptimizer::Impl::write_parameter_values(size_t g, int64_t offset, const at::Tensor& values,
                                                 bool async) {
  if (param_swapper_) {  // stage 3, the shards on NVMe
    param_swapper_->write(g, offset, values);
    return;
  }
  GroupShards& shard = shards_[g];
  if (shard.param_shard.defined()) {  // stage 3
    shard.param_shard.narrow(0, offset, values.numel()).copy_(values, async);
    return;
  }
  const GroupLayout& layout = layout_->group(g);
  for (const auto& bucket : layout.buckets()) {
    const int64_t begin = std::max(offset, bucket.shard_offset);
    const int64_t end = std::min(offset + values.numel(), bucket.shard_offset + bucket.shard_numel);
    if (begin < end) {
      shard.flat_param
          .narrow(0, layout.rank_slice_offset(bucket, comm_->rank()) + begin - bucket.shard_offset,
                  end - begin)
          .copy_(values.narrow(0, begin - offset, end - begin), async);
    }
  }
}

void ZeroOptimizer::Impl::refresh_parameters_from_master() {
  // A chunk at a time: with NVMe offload a whole fp32 master shard is what
  // host memory is not meant to hold.
  for (size_t g = 0; g < shards_.size(); ++g) {
    const int64_t numel = layout_->group(g).shard_numel();
    for (int64_t done = 0; done < numel; done += kShardChunkElements) {
      const int64_t length = std::min(kShardChunkElements, numel - done);
      write_parameter_values(g, done,
                             read_master(g, done, length).to(shards_[g].param_options.dtype()),
                             /*async=*/false);
    }
  }
}

int64_t ZeroOptimizer::Impl::device_model_state_bytes() const {
  int64_t bytes = gathered_parameter_bytes() + gradient_bytes();
  for (const auto& shard : shards_) {
    if (shard.param_shard.defined() && placement_->parameter_tier() == StateTier::kDevice) {
      bytes += shard.param_shard.numel() * static_cast<int64_t>(shard.param_shard.element_size());
    }
  }
  return bytes + (offloaded_ ? offloaded_->bytes(StateTier::kDevice) : optimizer_state_bytes());
}

int64_t ZeroOptimizer::Impl::host_model_state_bytes() const {
  int64_t bytes = offloaded_ ? offloaded_->bytes(StateTier::kHost) : 0;
  if (param_swapper_) {
    bytes += param_swapper_->host_shard_bytes() + param_swapper_->ahead_bytes();
  }
  for (const auto& shard : shards_) {
    if (shard.param_shard.defined() && placement_->parameter_tier() == StateTier::kHost) {
      bytes += shard.param_shard.numel() * static_cast<int64_t>(shard.param_shard.element_size());
    }
  }
  return bytes + host_gradient_bytes();
}

}  // namespace zeroshard
