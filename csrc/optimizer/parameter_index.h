// Which of the optimizer's parameters a tensor is, and the names a model
// gives each: how units, pins, buckets and checkpoints name a parameter.
// Internal to csrc/optimizer/.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <cstddef>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace zeroshard {

class ParameterIndex {
 public:
  using Groups = std::vector<torch::optim::OptimizerParamGroup>;
  using Position = std::pair<size_t, size_t>;  // (group, index in the group)

  // Indexes every parameter of `groups` by its TensorImpl (after validation;
  // again after stage 3 adopts new tensors). Names set earlier are kept.
  void rebuild(const Groups& groups);
  // The parameter `tensor` is (the same TensorImpl), or nullopt.
  std::optional<Position> find(const at::Tensor& tensor) const;

  // The names of each parameter (a tied parameter has several: the first is
  // its name, the others its aliases); tensors that are no parameter of
  // `groups` are ignored.
  void set_names(const Groups& groups,
                 const std::vector<std::pair<std::string, at::Tensor>>& named);
  // Its first name, or "group<g>.<i>" where it has none.
  std::string name(size_t group, size_t index) const;
  std::vector<std::string> aliases(size_t group, size_t index) const;

 private:
  std::unordered_map<const void*, Position> positions_;
  std::vector<std::vector<std::vector<std::string>>> names_;  // may be empty
};

}  // namespace zeroshard
