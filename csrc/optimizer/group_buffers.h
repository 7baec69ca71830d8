// What one parameter group's state is made of on this rank: the buffers the
// step, the gathers and the checkpoints work on. Internal to csrc/optimizer/.
#pragma once

#include "zeroshard/optimizer_states.h"
#include "zeroshard/partition_layout.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zeroshard {

// Per group, the buffers this rank holds: the whole flat parameter buffer
// (stages 1-2: every rank holds every parameter) and this rank's shards.
struct GroupBuffers {
  at::TensorOptions param_options;  // dtype and device of the parameters
  // Stages 1-2: 1D, layout.flat_numel(), parameter dtype; the model's
  // parameters are views into it. Not a shard: this rank's shard is its
  // slices (rank_slice_offset) of each bucket.
  at::Tensor flat_param;
  // Stage 3: this rank's parameter values, 1D, shard_numel, parameter dtype;
  // what the all-gathers send. For fp32 parameters it is also the master.
  at::Tensor param_shard;
  // The optimizer states by OptimizerStateName, each 1D, shard_numel, fp32,
  // undefined where not kept: the master is undefined when the parameters
  // are fp32 (their master values are this rank's slices of flat_param or
  // param_shard: [Note: fp32 master] in zero_optimizer_master.cpp), a moment
  // where the inner optimizer keeps none (inner_optimizer_states), and all of
  // them with offload_optimizer (OffloadedOptimizerState holds them).
  // Construction, the device update and stage 3's gather read them here;
  // everything else goes through ShardStorage (shard_storage.h).
  // Indexed by the enum's value; registered names ([Note: open state names]
  // in optimizer_states.h) grow it on first use.
  std::vector<at::Tensor> states;
  std::vector<int64_t> steps;          // per parameter: updates applied so far
  std::vector<ShardSegment> segments;  // what this rank owns

  at::Tensor& state(OptimizerStateName name) {
    const auto index = static_cast<size_t>(name);
    if (index >= states.size()) {
      states.resize(index + 1);
    }
    return states[index];
  }
  const at::Tensor& state(OptimizerStateName name) const {
    static const at::Tensor kAbsent;
    const auto index = static_cast<size_t>(name);
    return index < states.size() ? states[index] : kAbsent;
  }
};

}  // namespace zeroshard
