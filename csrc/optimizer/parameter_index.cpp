#include "parameter_index.h"

namespace zeroshard {

void ParameterIndex::rebuild(const Groups& groups) {
  positions_.clear();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      positions_.emplace(params[i].unsafeGetTensorImpl(), Position{g, i});
    }
  }
}

std::optional<ParameterIndex::Position> ParameterIndex::find(const at::Tensor& tensor) const {
  const auto found = positions_.find(tensor.unsafeGetTensorImpl());
  if (found == positions_.end()) {
    return std::nullopt;
  }
  return found->second;
}

void ParameterIndex::set_names(const Groups& groups,
                               const std::vector<std::pair<std::string, at::Tensor>>& named) {
  names_.assign(groups.size(), {});
  for (size_t g = 0; g < groups.size(); ++g) {
    names_[g].resize(groups[g].params().size());
  }
  for (const auto& [name, tensor] : named) {
    if (const auto position = find(tensor)) {
      names_[position->first][position->second].push_back(name);
    }
  }
}

std::string ParameterIndex::name(size_t group, size_t index) const {
  if (group < names_.size() && !names_[group][index].empty()) {
    return names_[group][index].front();
  }
  return "group" + std::to_string(group) + "." + std::to_string(index);
}

std::vector<std::string> ParameterIndex::aliases(size_t group, size_t index) const {
  if (group < names_.size() && names_[group][index].size() > 1) {
    return {names_[group][index].begin() + 1, names_[group][index].end()};
  }
  return {};
}

}  // namespace zeroshard
