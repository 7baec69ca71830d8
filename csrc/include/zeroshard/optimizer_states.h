// The states an optimizer shard may hold and their names: one list, used by
// the step's storage (shard_storage.h), the per-rank state_dict, the
// checkpoints and their loading.
//
// [Note: open state names]
// The built-in update rules keep the five states of the enum. An update rule
// of the user's (update_rule.h: RAdam's moments, Adagrad's "sum", Rprop's
// "prev" and "step_size") names its own states; each new name is registered
// once per process and gets the next value of the enum, so storage, state
// dicts and checkpoints handle every state alike, by value and by name. The
// values of registered names may differ between processes: only names are
// ever written down.
#pragma once

#include <string>
#include <vector>

namespace zeroshard {

enum class OptimizerStateName : int { kMaster, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kMomentumBuffer };

// How many of the enum's values are built in (the registered ones follow).
inline constexpr int kBuiltinOptimizerStates = 5;

// The state of this name: a built-in one, or one registered now (letters,
// digits and underscores; "master" is the built-in master). Thread-safe.
OptimizerStateName optimizer_state_named(const std::string& name);

// The name checkpoints and state_dict keys give a state (torch.optim's names
// for the moments).
const char* optimizer_state_name(OptimizerStateName name);

// Every state this process knows, in the enum's order (the master first,
// then the built-in moments, then the registered ones).
std::vector<OptimizerStateName> all_optimizer_states();

}  // namespace zeroshard
