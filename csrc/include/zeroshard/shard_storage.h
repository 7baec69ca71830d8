// zeroshard::ShardStorage: where one rank's optimizer states live (the fp32
// master and the inner optimizer's moments of each parameter group's shard),
// behind one interface. Two tiers implement it: the training device
// (DeviceShardStorage in csrc/optimizer/, over the group's own tensors) and
// host memory or NVMe (OffloadedOptimizerState).
//
// [Note: one home for the shard's states]
// Checkpoints, the per-rank state_dict, loading, partitioned construction and
// the byte counts read and write states through this interface and never ask
// where a state lives; each tier answers for itself (the device tier knows
// that an fp32 model's master values are slices of its parameters, the
// offloaded one which sub-groups sit on NVMe). Which states exist is
// inner_optimizer_states' answer (inner_optimizer.h). The update has one
// entry, update(), and each tier does it its own way: the ATen path on
// device shards, the fused host kernel on offloaded ones; no caller asks
// which.
#pragma once

#include "zeroshard/optimizer_states.h"
#include "zeroshard/shard_chunk.h"
#include "zeroshard/state_placement.h"
#include "zeroshard/update_rule.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace zeroshard {

class ShardStorage {
 public:
  virtual ~ShardStorage() = default;

  // Adds the states of `names` that group `group` lacks, zeroed (the moments
  // the inner optimizer keeps: inner_optimizer_states); keeps the rest.
  virtual void ensure_states(size_t group, const std::vector<OptimizerStateName>& names) = 0;
  // Whether group `group` holds `name` now.
  virtual bool has(size_t group, OptimizerStateName name) const = 0;
  // A copy of [offset, offset + length) of the named state, in fp32, on
  // `options`' device.
  virtual at::Tensor read(size_t group, OptimizerStateName name, int64_t offset, int64_t length,
                          const at::TensorOptions& options) const = 0;
  // The same range as a view of the state itself, where the tier has one
  // (device moments), to read without a copy (checkpoint saves); undefined
  // where it has none. Read-only.
  virtual at::Tensor view(size_t /*group*/, OptimizerStateName /*name*/, int64_t /*offset*/,
                          int64_t /*length*/) const {
    return {};
  }
  // Writes `values` (1D, any dtype and device) at `offset`, allocating the
  // state if it was missing.
  virtual void write(size_t group, OptimizerStateName name, int64_t offset,
                     const at::Tensor& values) = 0;
  // The whole state from `values` (1D, shard-sized), which the caller gives
  // up: a tier may keep the tensor itself instead of a copy (a load's
  // buffers; never a user's tensor).
  virtual void adopt(size_t group, OptimizerStateName name, const at::Tensor& values) {
    write(group, name, 0, values);
  }
  // Bytes held on `tier` (state and the tier's staging buffers).
  virtual int64_t bytes(StateTier tier) const = 0;
  // Where a copy of a state lands by default: the device the states are
  // used on (the training device; the host for offloaded ones).
  virtual c10::Device home_device() const = 0;

  // ---- The update ----
  // One contiguous range of a group's shard whose elements share a step
  // count, inside one bucket of the layout.
  struct UpdateRun {
    int64_t offset = 0;
    int64_t length = 0;
    int64_t step = 0;
    int64_t bucket = 0;
  };
  // One piece of a parameter an update rule updates ([Note: elementwise
  // rules on shards] in update_rule.h): the parameter (tensors unset) and
  // where the piece lies in the group's shard.
  struct RulePiece {
    ParameterShard parameter;
    int64_t shard_offset = 0;
    int64_t numel = 0;
  };
  struct UpdateCallbacks {
    // The runs of buckets below `end` are updated: their parameters may be
    // gathered. The device tier calls it as its update moves past each
    // bucket, and with every bucket at the end of the group.
    std::function<void(size_t end)> buckets_updated;
    // Offloaded tiers: a run's new values, in the parameters' dtype, for the
    // copy of the parameters the device uses (may copy asynchronously; the
    // update returns when every copy has completed).
    std::function<void(int64_t offset, const at::Tensor& values, bool async)> write_parameters;
    // An update rule's pieces of the runs (offloaded tiers; the device tier
    // lists its own).
    std::function<std::vector<RulePiece>(const std::vector<UpdateRun>& runs)> rule_pieces;
  };
  // Applies the update rule to `runs` of group `group` (sorted by offset):
  // gradient = grad_shard * grad_scale (the device tier's shard is already
  // averaged: grad_scale 1).
  virtual void update(size_t group, const torch::optim::OptimizerOptions& options,
                      const std::vector<UpdateRun>& runs, const at::Tensor& grad_shard,
                      double grad_scale, bool fused, const UpdateCallbacks& callbacks) = 0;

  // Calls fn(offset, values) over [offset, offset + length) of `name`, at
  // most kShardChunkElements at a time (fp32 copies on `options`' device):
  // for passes where no whole-shard temporary may exist (NVMe).
  template <typename F>
  void for_each_chunk(size_t group, OptimizerStateName name, int64_t offset, int64_t length,
                      const at::TensorOptions& options, F&& fn) const {
    for (int64_t done = 0; done < length; done += kShardChunkElements) {
      const int64_t numel = std::min(kShardChunkElements, length - done);
      fn(offset + done, read(group, name, offset + done, numel, options));
    }
  }
};

}  // namespace zeroshard
