// ParameterStates: the states of a shape of their own that this rank holds
// for the whole parameters it owns ([Note: parameter states] in
// update_rule.h), one flat fp32 tensor per group. Internal to
// csrc/optimizer/.
#pragma once

#include "zeroshard/optimizer_states.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/update_rule.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <vector>

namespace zeroshard {

class ParameterStates {
 public:
  // One state of one owned parameter.
  struct Entry {
    OptimizerStateName name;
    std::vector<int64_t> sizes;
    int64_t offset = 0;  // in its group's flat tensor
    int64_t numel = 0;
  };

  ParameterStates() = default;
  // Zeroed states, per group with `options[g]` (fp32, on the tier that
  // holds the group's states), for the parameters of `segments` (this
  // rank's, per group) in groups whose rule keeps parameter states. The
  // rules' answers were checked on every rank (check_rule_parameters).
  ParameterStates(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                  const std::vector<std::vector<ShardSegment>>& segments,
                  const std::vector<at::TensorOptions>& options);

  // What the group's rule keeps for its parameter `index`, on any rank.
  static std::vector<ParameterStateSpec> specs(const torch::optim::OptimizerParamGroup& group,
                                               size_t index);

  bool any() const { return bytes_ > 0; }
  // This rank's states of parameter `index` of group g; empty where it owns
  // none.
  const std::vector<Entry>& entries(size_t g, int64_t index) const;
  // Every owned parameter's entries in group g, by parameter index.
  const std::map<int64_t, std::vector<Entry>>& group_entries(size_t g) const {
    return entries_.at(g);
  }
  // The same as tensors of their shapes, views of the flat tensor.
  std::vector<at::Tensor> views(size_t g, int64_t index) const;
  // Group g's flat tensor (undefined where it holds none).
  const at::Tensor& flat(size_t g) const { return flat_.at(g); }
  at::Tensor& flat(size_t g) { return flat_.at(g); }
  int64_t bytes() const { return bytes_; }
  int64_t bytes(size_t g) const {
    return flat_.at(g).defined() ? flat_[g].numel() * static_cast<int64_t>(sizeof(float)) : 0;
  }

 private:
  std::vector<at::Tensor> flat_;
  std::vector<std::map<int64_t, std::vector<Entry>>> entries_;
  int64_t bytes_ = 0;
};

}  // namespace zeroshard
