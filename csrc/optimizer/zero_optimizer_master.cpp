// ZeroOptimizer: the master values and the parameters the device uses, at
// every stage and placement. Where the master lives is the storage's
// ([Note: one home for the shard's states] in shard_storage.h: the device
// tier in device_shard_storage.cpp, the host/NVMe tier in
// offloaded_optimizer_state.cpp); here it meets the parameters.
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
  return buffers_[0].param_options.dtype(at::kFloat);
}

at::Tensor ZeroOptimizer::Impl::master_slice(size_t g, const Bucket& bucket) {
  TORCH_INTERNAL_ASSERT(!offloaded_, "master_slice: offloaded masters have no device view");
  return device_storage_->master_view(g, bucket);
}

at::Tensor ZeroOptimizer::Impl::master_shard(size_t g) const {
  return read_master(g, 0, layout_->group(g).shard_numel());
}

at::Tensor ZeroOptimizer::Impl::read_master(size_t g, int64_t offset, int64_t length) const {
  return storage().read(g, OptimizerStateName::kMaster, offset, length, fp32_options());
}

void ZeroOptimizer::Impl::write_master(size_t g, int64_t offset, const at::Tensor& values) {
  storage().write(g, OptimizerStateName::kMaster, offset, values.to(at::kFloat));
}

void ZeroOptimizer::Impl::write_parameter_values(size_t g, int64_t offset, const at::Tensor& values,
                                                 bool async) {
  if (param_swapper_) {  // stage 3, the shards on NVMe
    param_swapper_->write(g, offset, values);
    return;
  }
  GroupBuffers& shard = buffers_[g];
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
          .narrow(0,
                  layout.rank_slice_offset(bucket, groups_->shard().rank()) + begin -
                      bucket.shard_offset,
                  end - begin)
          .copy_(values.narrow(0, begin - offset, end - begin), async);
    }
  }
}

void ZeroOptimizer::Impl::refresh_parameters_from_master() {
  // A chunk at a time: with NVMe offload a whole fp32 master shard is what
  // host memory is not meant to hold.
  for (size_t g = 0; g < buffers_.size(); ++g) {
    storage().for_each_chunk(g, OptimizerStateName::kMaster, 0, layout_->group(g).shard_numel(),
                             fp32_options(), [&](int64_t offset, const at::Tensor& values) {
                               write_parameter_values(g, offset,
                                                      values.to(buffers_[g].param_options.dtype()),
                                                      /*async=*/false);
                             });
  }
}

}  // namespace zeroshard
