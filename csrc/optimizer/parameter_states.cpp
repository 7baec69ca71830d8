#include "parameter_states.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

namespace zeroshard {

std::vector<ParameterStateSpec> ParameterStates::specs(
    const torch::optim::OptimizerParamGroup& group, size_t index) {
  const auto* rule = dynamic_cast<const RuleOptions*>(&group.options());
  if (rule == nullptr) {
    return {};
  }
  return rule->rule()->parameter_states(group.params().at(index).sizes().vec(),
                                        rule->hyperparameters());
}

ParameterStates::ParameterStates(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                 const std::vector<std::vector<ShardSegment>>& segments,
                                 const std::vector<at::TensorOptions>& options) {
  flat_.resize(groups.size());
  entries_.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    int64_t total = 0;
    for (const ShardSegment& segment : segments.at(g)) {
      if (segment.numel == 0) {
        continue;
      }
      const auto i = static_cast<size_t>(segment.param_index);
      const std::vector<ParameterStateSpec> wanted = specs(groups[g], i);
      if (wanted.empty()) {
        continue;
      }
      TORCH_INTERNAL_ASSERT(
          segment.param_offset == 0 && segment.numel == groups[g].params()[i].numel(),
          "parameter states of a parameter that is not whole on this rank");
      std::vector<Entry>& out = entries_[g][segment.param_index];
      for (const ParameterStateSpec& spec : wanted) {
        int64_t numel = 1;
        for (int64_t size : spec.sizes) {
          numel *= size;
        }
        out.push_back({optimizer_state_named(spec.name), spec.sizes, total, numel});
        total += numel;
      }
    }
    if (total > 0) {
      flat_[g] = at::zeros({total}, options.at(g).dtype(at::kFloat));
      bytes_ += total * static_cast<int64_t>(sizeof(float));
    }
  }
}

const std::vector<ParameterStates::Entry>& ParameterStates::entries(size_t g, int64_t index) const {
  static const std::vector<Entry> kNone;
  if (g >= entries_.size()) {
    return kNone;
  }
  const auto found = entries_[g].find(index);
  return found == entries_[g].end() ? kNone : found->second;
}

std::vector<at::Tensor> ParameterStates::views(size_t g, int64_t index) const {
  std::vector<at::Tensor> out;
  for (const Entry& entry : entries(g, index)) {
    out.push_back(flat_[g].narrow(0, entry.offset, entry.numel).view(entry.sizes));
  }
  return out;
}

}  // namespace zeroshard
