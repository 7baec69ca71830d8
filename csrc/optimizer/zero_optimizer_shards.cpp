// ZeroOptimizer: each rank's shards built at construction: stages 1-2 from
// one flat buffer per group (the parameters become its views), stage 3 bucket
// by bucket (or into the parameter swap file), the fp32 master and the
// optimizer state shards; the initial values are broadcast from
// broadcast_from_rank (and, with hybrid sharding, from the first replica).
#include "zero_optimizer_impl.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard {

void ZeroOptimizer::Impl::broadcast_buffers(const std::vector<at::Tensor>& buffers) {
  at::NoGradGuard no_grad;
  // One broadcast per dtype (a model's buffers are many and small: a
  // BatchNorm has three), in the order the dtypes first appear, which every
  // rank passing the same buffers shares. Meta buffers hold no values yet.
  std::vector<c10::ScalarType> dtypes;
  for (const auto& buffer : buffers) {
    if (buffer.defined() && !buffer.is_meta() && buffer.numel() > 0 &&
        std::find(dtypes.begin(), dtypes.end(), buffer.scalar_type()) == dtypes.end()) {
      dtypes.push_back(buffer.scalar_type());
    }
  }
  for (const c10::ScalarType dtype : dtypes) {
    std::vector<at::Tensor> same;
    std::vector<at::Tensor> flat;
    for (const auto& buffer : buffers) {
      if (buffer.defined() && !buffer.is_meta() && buffer.numel() > 0 &&
          buffer.scalar_type() == dtype) {
        same.push_back(buffer.detach());
        // Bytes: not every backend broadcasts bool.
        flat.push_back(
            buffer.detach().to(device_, dtype == at::kBool ? at::kByte : dtype).reshape({-1}));
      }
    }
    at::Tensor all = at::cat(flat);
    const std::string tag = std::string("buffers/") + c10::toString(dtype);
    groups_->shard().broadcast(all, options_.broadcast_from_rank(), tag);
    groups_->broadcast_across_replicas(all, tag);
    int64_t offset = 0;
    for (auto& buffer : same) {
      buffer.copy_(all.narrow(0, offset, buffer.numel()).view(buffer.sizes()));
      offset += buffer.numel();
    }
  }
}

void ZeroOptimizer::Impl::build_group_shards() {
  const int64_t rank = groups_->shard().rank();
  at::NoGradGuard no_grad;
  replacements_.assign(param_groups_.size(), {});
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const GroupLayout& layout = layout_->group(g);
    auto& params = param_groups_[g].params();
    GroupBuffers& shard = buffers_[g];
    const auto param_options = shard.param_options;
    shard.steps.assign(params.size(), 0);
    shard.segments = layout.segments_of_rank(rank);
    if (options_.stage() == 3) {
      build_stage3_shards(g);
      ensure_state_tensors(g);
      continue;
    }
    shard.flat_param = at::zeros({layout.flat_numel()}, param_options);
    for (size_t i = 0; i < params.size(); ++i) {
      const ParamSlot& slot = layout.slot_of_param(static_cast<int64_t>(i));
      shard.flat_param.narrow(0, slot.flat_offset, slot.numel)
          .copy_(params[i].detach().reshape({-1}));
    }
    groups_->shard().broadcast(shard.flat_param, options_.broadcast_from_rank(),
                               "group" + std::to_string(g) + "/initial_params");
    groups_->broadcast_across_replicas(shard.flat_param,
                                       "group" + std::to_string(g) + "/initial_params");
    // The model's parameters become views into the flat buffer, so the
    // all-gather after each step writes them with no extra copy.
    for (size_t i = 0; i < params.size(); ++i) {
      const ParamSlot& slot = layout.slot_of_param(static_cast<int64_t>(i));
      params[i].set_data(
          shard.flat_param.narrow(0, slot.flat_offset, slot.numel).view(params[i].sizes()));
    }
    if (offloaded_) {
      offloaded_->initialize_group(g, device_storage_->read(g, OptimizerStateName::kMaster, 0,
                                                            layout.shard_numel(), fp32_options()));
    } else if (params[0].scalar_type() != at::kFloat) {
      shard.state(OptimizerStateName::kMaster) = at::empty({layout.shard_numel()}, fp32_options());
      for (const auto& bucket : layout.buckets()) {
        shard.state(OptimizerStateName::kMaster)
            .narrow(0, bucket.shard_offset, bucket.shard_numel)
            .copy_(shard.flat_param.narrow(0, layout.rank_slice_offset(bucket, rank),
                                           bucket.shard_numel));
      }
    }
    ensure_state_tensors(g);
  }
}

// Stage 3: each bucket is assembled in its full buffer once (from the
// parameters, or zeros for meta parameters), this rank keeps its slice in
// param_shard, the parameters become views of the buffer, and the buffer's
// storage is freed unless the bucket is persistent.
void ZeroOptimizer::Impl::build_stage3_shards(size_t g) {
  const int64_t rank = groups_->shard().rank();
  const GroupLayout& layout = layout_->group(g);
  auto& params = param_groups_[g].params();
  GroupBuffers& shard = buffers_[g];
  const bool meta = params[0].is_meta();
  // offload_param: the shard lives on the host ('cpu': gathers copy it over
  // first) or in the parameter swap file ('nvme').
  if (offloaded_) {
    // The fp32 master is written bucket by bucket below: a whole fp32 copy of
    // the shard would be the construction's peak (4 bytes per shard element,
    // twice the bf16 parameter shard that NVMe keeps out of memory).
    offloaded_->prepare_group(g);
  }
  if (!param_swapper_) {
    shard.param_shard =
        at::zeros({layout.shard_numel()},
                  placement_->options(placement_->parameter_tier(),
                                      c10::typeMetaToScalarType(shard.param_options.dtype()),
                                      /*for_parameters=*/true));
  }
  replacements_[g].assign(params.size(), at::Tensor());
  for (size_t b = 0; b < layout.buckets().size(); ++b) {
    const Bucket& bucket = layout.buckets()[b];
    gatherer_->ensure_allocated(g, b);
    at::Tensor& full = gatherer_->full(g, b);
    full.zero_();
    if (!meta) {
      for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
        const ParamSlot& slot = layout.slots()[s];
        full.narrow(0, slot.flat_offset - bucket.flat_offset, slot.numel)
            .copy_(params[slot.param_index].detach().reshape({-1}));
      }
      groups_->shard().broadcast(full, options_.broadcast_from_rank(),
                                 "group" + std::to_string(g) + "/initial_params");
      groups_->broadcast_across_replicas(full, "group" + std::to_string(g) + "/initial_params");
      gatherer_->mark_initialized(g, b);
    }
    const at::Tensor mine = full.narrow(0, rank * bucket.shard_numel, bucket.shard_numel);
    if (param_swapper_) {
      param_swapper_->write(g, bucket.shard_offset, mine);
    } else {
      shard.param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel).copy_(mine);
    }
    if (offloaded_) {
      offloaded_->write(g, OptimizerStateName::kMaster, bucket.shard_offset, mine);
    }
    for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
      const ParamSlot& slot = layout.slots()[s];
      at::Tensor& param = params[slot.param_index];
      at::Tensor view =
          full.narrow(0, slot.flat_offset - bucket.flat_offset, slot.numel).view(param.sizes());
      if (meta) {
        // A tensor of its own whose data is the view: views share their
        // base's version counter, and the gathers write the base in place,
        // which autograd would take for an edit of a saved parameter.
        at::Tensor replacement = at::empty({0}, shard.param_options);
        replacement.set_data(view);
        replacements_[g][slot.param_index] = replacement;
      } else {
        param.set_data(view);
      }
    }
    gatherer_->release(g, b);  // no-op for persistent buckets
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) {  // in no bucket
      at::Tensor empty = at::empty(params[i].sizes(), shard.param_options);
      if (meta) {
        replacements_[g][i] = empty;
      } else {
        params[i].set_data(empty);
      }
    }
  }
  if (!offloaded_ && shard.param_options.dtype() != at::kFloat) {
    shard.state(OptimizerStateName::kMaster) = shard.param_shard.to(at::kFloat);
  }
}

void ZeroOptimizer::Impl::ensure_state_tensors(size_t g) {
  storage().ensure_states(g, inner_optimizer_states(inner_kind_, param_groups_[g].options()));
}

}  // namespace zeroshard
