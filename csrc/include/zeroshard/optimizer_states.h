// The states an optimizer shard may hold and their names: one list, used by
// the step's storage (offloaded_optimizer_state.h), the per-rank state_dict,
// the checkpoints and their loading.
#pragma once

#include <array>

namespace zeroshard {

enum class OptimizerStateName { kMaster, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kMomentumBuffer };

// Every state, in the enum's order (the master first).
inline constexpr std::array<OptimizerStateName, 5> kAllOptimizerStates = {
    OptimizerStateName::kMaster, OptimizerStateName::kExpAvg, OptimizerStateName::kExpAvgSq,
    OptimizerStateName::kMaxExpAvgSq, OptimizerStateName::kMomentumBuffer};

// The name checkpoints and state_dict keys give a state (torch.optim's names
// for the moments).
constexpr const char* optimizer_state_name(OptimizerStateName name) {
  switch (name) {
    case OptimizerStateName::kMaster:
      return "master";
    case OptimizerStateName::kExpAvg:
      return "exp_avg";
    case OptimizerStateName::kExpAvgSq:
      return "exp_avg_sq";
    case OptimizerStateName::kMaxExpAvgSq:
      return "max_exp_avg_sq";
    case OptimizerStateName::kMomentumBuffer:
      return "momentum_buffer";
  }
  return "?";
}

}  // namespace zeroshard
