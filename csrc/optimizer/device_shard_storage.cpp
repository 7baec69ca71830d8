#include "device_shard_storage.h"

#include "zeroshard/update_rule.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>

namespace zeroshard {

DeviceShardStorage::DeviceShardStorage(std::vector<GroupBuffers>& buffers,
                                       const PartitionLayout& layout, int64_t rank,
                                       c10::Device device, InnerOptimizerKind kind,
                                       std::vector<std::vector<std::vector<int64_t>>> param_shapes)
    : buffers_(buffers),
      layout_(layout),
      rank_(rank),
      device_(device),
      kind_(kind),
      param_shapes_(std::move(param_shapes)) {}

void DeviceShardStorage::update(size_t g, const torch::optim::OptimizerOptions& options,
                                const std::vector<UpdateRun>& runs, const at::Tensor& grad_shard,
                                double grad_scale, bool fused, const UpdateCallbacks& callbacks) {
  TORCH_INTERNAL_ASSERT(grad_scale == 1.0, "the device tier's gradient shard is averaged in place");
  GroupBuffers& shard = buffers_[g];
  const GroupLayout& layout = layout_.group(g);
  // A 16-bit gradient is widened a chunk at a time: a whole-shard fp32 copy
  // was 4 bytes per shard element on top of the model states, the largest
  // transient of a stage 3 step.
  const bool widen = grad_shard.scalar_type() != at::kFloat;
  if (kind_ == InnerOptimizerKind::kRule) {
    // A rule of the user's may fail on one rank only (its owner's matrix, a
    // device the probe did not see): the gathers still launch, in the order
    // every rank launches them, and the step agrees on the failure after
    // them (update_shards), so no rank is left alone in a collective.
    std::exception_ptr failure;
    try {
      update_by_rule(g, static_cast<const RuleOptions&>(options), runs, grad_shard);
    } catch (...) {
      failure = std::current_exception();
    }
    if (callbacks.buckets_updated) {
      callbacks.buckets_updated(layout.buckets().size());
    }
    if (failure) {
      std::rethrow_exception(failure);
    }
    return;
  }
  for (const UpdateRun& run : runs) {
    if (callbacks.buckets_updated) {  // the buckets before this run are complete
      callbacks.buckets_updated(static_cast<size_t>(run.bucket));
    }
    const Bucket& bucket = layout.buckets()[run.bucket];
    at::Tensor master =
        master_view(g, bucket).narrow(0, run.offset - bucket.shard_offset, run.length);
    // The update is elementwise: chunks of a run give the values the whole
    // run would.
    const int64_t chunk = widen ? kShardChunkElements : run.length;
    for (int64_t done = 0; done < run.length; done += chunk) {
      const int64_t numel = std::min(chunk, run.length - done);
      auto part = [&](const at::Tensor& t) {
        return t.defined() ? t.narrow(0, run.offset + done, numel) : at::Tensor();
      };
      at::Tensor grad = part(grad_shard);
      ShardView view{master.narrow(0, done, numel),
                     widen ? grad.to(at::kFloat) : grad,
                     part(shard.state(OptimizerStateName::kExpAvg)),
                     part(shard.state(OptimizerStateName::kExpAvgSq)),
                     part(shard.state(OptimizerStateName::kMaxExpAvgSq)),
                     part(shard.state(OptimizerStateName::kMomentumBuffer))};
      apply_inner_update(kind_, options, view, run.step, fused);
    }
  }
  if (callbacks.buckets_updated) {
    // The rest of this group's buckets, before the next group's: which
    // buckets a rank's runs fall in depends on its slice and on skipped
    // parameters, but the order of the gathers must not.
    callbacks.buckets_updated(layout.buckets().size());
  }
}

std::vector<ShardStorage::RulePiece> DeviceShardStorage::rule_pieces(
    size_t g, const std::vector<UpdateRun>& runs) const {
  const GroupBuffers& shard = buffers_[g];
  const GroupLayout& layout = layout_.group(g);
  std::vector<RulePiece> pieces;
  auto segment = shard.segments.begin();
  for (const UpdateRun& run : runs) {
    for (; segment != shard.segments.end() && segment->shard_offset < run.offset + run.length;
         ++segment) {
      if (segment->shard_offset < run.offset || segment->numel == 0) {
        continue;
      }
      TORCH_INTERNAL_ASSERT(
          !layout.whole_parameters() ||
              (segment->param_offset == 0 &&
               segment->numel == layout.slot_of_param(segment->param_index).numel),
          "a whole-parameter layout split parameter ", segment->param_index);
      RulePiece piece;
      piece.parameter.group = g;
      piece.parameter.parameter = segment->param_index;
      piece.parameter.param_offset = segment->param_offset;
      piece.parameter.sizes = param_shapes_[g][segment->param_index];
      piece.parameter.step = run.step;
      if (parameter_states_ != nullptr) {
        piece.parameter.parameter_states = parameter_states_->views(g, segment->param_index);
      }
      piece.shard_offset = segment->shard_offset;
      piece.numel = segment->numel;
      pieces.push_back(std::move(piece));
    }
  }
  return pieces;
}

void DeviceShardStorage::update_by_rule(size_t g, const RuleOptions& options,
                                        const std::vector<UpdateRun>& runs,
                                        const at::Tensor& grad_shard) {
  GroupBuffers& shard = buffers_[g];
  const GroupLayout& layout = layout_.group(g);
  const std::vector<OptimizerStateName> states = rule_states(options);
  std::vector<ParameterShard> pieces;
  size_t run = 0;
  for (RulePiece& piece : rule_pieces(g, runs)) {
    while (piece.shard_offset >= runs[run].offset + runs[run].length) {
      ++run;
    }
    const Bucket& bucket = layout.buckets()[runs[run].bucket];
    ParameterShard& out = piece.parameter;
    out.param =
        master_view(g, bucket).narrow(0, piece.shard_offset - bucket.shard_offset, piece.numel);
    out.grad = grad_shard.narrow(0, piece.shard_offset, piece.numel).to(at::kFloat);
    for (OptimizerStateName name : states) {
      out.states.push_back(shard.state(name).narrow(0, piece.shard_offset, piece.numel));
    }
    pieces.push_back(std::move(out));
  }
  if (!pieces.empty()) {
    options.rule()->update(options.hyperparameters(), pieces);
  }
}

at::Tensor DeviceShardStorage::master_view(size_t g, const Bucket& bucket) const {
  const GroupBuffers& group = buffers_[g];
  const at::Tensor& master = group.state(OptimizerStateName::kMaster);
  if (master.defined()) {
    return master.narrow(0, bucket.shard_offset, bucket.shard_numel);
  }
  if (group.param_shard.defined()) {  // stage 3, fp32
    return group.param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel);
  }
  return group.flat_param.narrow(0, layout_.group(g).rank_slice_offset(bucket, rank_),
                                 bucket.shard_numel);
}

void DeviceShardStorage::ensure_states(size_t g, const std::vector<OptimizerStateName>& names) {
  GroupBuffers& group = buffers_[g];
  const int64_t numel = layout_.group(g).shard_numel();
  for (OptimizerStateName name : names) {
    at::Tensor& state = group.state(name);
    if (!state.defined()) {
      state = at::zeros({numel}, group.param_options.dtype(at::kFloat));
    }
  }
}

bool DeviceShardStorage::has(size_t g, OptimizerStateName name) const {
  // The master always exists: a tensor of its own or the parameters' values.
  return name == OptimizerStateName::kMaster || buffers_[g].state(name).defined();
}

at::Tensor DeviceShardStorage::read(size_t g, OptimizerStateName name, int64_t offset,
                                    int64_t length, const at::TensorOptions& options) const {
  at::Tensor out = at::empty({length}, options.dtype(at::kFloat));
  if (name != OptimizerStateName::kMaster) {
    TORCH_CHECK(has(g, name), "group ", g, " holds no ", optimizer_state_name(name));
    return out.copy_(buffers_[g].state(name).narrow(0, offset, length));
  }
  // The master of an fp32 model lies in the buckets' slices of the
  // parameters: copy the range bucket by bucket.
  for (const auto& bucket : layout_.group(g).buckets()) {
    const int64_t begin = std::max(offset, bucket.shard_offset);
    const int64_t end = std::min(offset + length, bucket.shard_offset + bucket.shard_numel);
    if (begin < end) {
      out.narrow(0, begin - offset, end - begin)
          .copy_(master_view(g, bucket).narrow(0, begin - bucket.shard_offset, end - begin));
    }
  }
  return out;
}

at::Tensor DeviceShardStorage::view(size_t g, OptimizerStateName name, int64_t offset,
                                    int64_t length) const {
  const at::Tensor& state = buffers_[g].state(name);
  return name != OptimizerStateName::kMaster && state.defined() ? state.narrow(0, offset, length)
                                                                : at::Tensor();
}

void DeviceShardStorage::write(size_t g, OptimizerStateName name, int64_t offset,
                               const at::Tensor& values) {
  if (name != OptimizerStateName::kMaster) {
    ensure_states(g, {name});
    buffers_[g].state(name).narrow(0, offset, values.numel()).copy_(values);
    return;
  }
  for (const auto& bucket : layout_.group(g).buckets()) {
    const int64_t begin = std::max(offset, bucket.shard_offset);
    const int64_t end = std::min(offset + values.numel(), bucket.shard_offset + bucket.shard_numel);
    if (begin < end) {
      master_view(g, bucket)
          .narrow(0, begin - bucket.shard_offset, end - begin)
          .copy_(values.narrow(0, begin - offset, end - begin));
    }
  }
}

void DeviceShardStorage::adopt(size_t g, OptimizerStateName name, const at::Tensor& values) {
  at::Tensor& state = buffers_[g].state(name);
  if (name == OptimizerStateName::kMaster || state.defined()) {
    write(g, name, 0, values);
    return;
  }
  // A moment not yet allocated (a load before the first step): no second
  // shard-sized buffer when the values already are fp32 on this device.
  state = values.to(buffers_[g].param_options.dtype(at::kFloat));
}

int64_t DeviceShardStorage::bytes(StateTier tier) const {
  if (tier != StateTier::kDevice) {
    return 0;
  }
  // Tensors of their own only: an fp32 model's master is its parameters.
  int64_t bytes = 0;
  for (const GroupBuffers& group : buffers_) {
    for (const at::Tensor& state : group.states) {
      if (state.defined()) {
        bytes += state.numel() * static_cast<int64_t>(state.element_size());
      }
    }
  }
  return bytes;
}

}  // namespace zeroshard
