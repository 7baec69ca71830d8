#include "zeroshard/optimizer_states.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <deque>
#include <mutex>

namespace zeroshard {
namespace {

// The names, by value. A deque: registering a name never moves the others,
// so the pointers optimizer_state_name returns stay valid.
struct StateNames {
  std::mutex mutex;
  std::deque<std::string> names{"master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                "momentum_buffer"};
};

StateNames& state_names() {
  static StateNames* names = new StateNames();  // never destroyed: read at exit
  return *names;
}

}  // namespace

OptimizerStateName optimizer_state_named(const std::string& name) {
  TORCH_CHECK_VALUE(
      !name.empty() && std::all_of(name.begin(), name.end(),
                                   [](unsigned char c) { return std::isalnum(c) || c == '_'; }),
      "optimizer state name '", name,
      "' is not usable: a state is named by letters, digits and underscores "
      "(it becomes a checkpoint and state_dict key)");
  StateNames& all = state_names();
  std::lock_guard<std::mutex> lock(all.mutex);
  const auto it = std::find(all.names.begin(), all.names.end(), name);
  if (it != all.names.end()) {
    return static_cast<OptimizerStateName>(it - all.names.begin());
  }
  all.names.push_back(name);
  return static_cast<OptimizerStateName>(all.names.size() - 1);
}

const char* optimizer_state_name(OptimizerStateName name) {
  StateNames& all = state_names();
  std::lock_guard<std::mutex> lock(all.mutex);
  const auto index = static_cast<size_t>(name);
  return index < all.names.size() ? all.names[index].c_str() : "?";
}

std::vector<OptimizerStateName> all_optimizer_states() {
  StateNames& all = state_names();
  std::lock_guard<std::mutex> lock(all.mutex);
  std::vector<OptimizerStateName> out;
  for (size_t i = 0; i < all.names.size(); ++i) {
    out.push_back(static_cast<OptimizerStateName>(i));
  }
  return out;
}

}  // namespace zeroshard
