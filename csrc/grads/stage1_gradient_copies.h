// Stage 1 with overlap: the .grad tensors the gradient hooks copied into the
// buckets this step, and whether those copies are still what .grad holds
// ([Note: stage 1 overlap] in gradient_reduction.cpp). Internal to
// csrc/grads/.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zeroshard {

class Stage1GradientCopies {
 public:
  // A new step: nothing copied, nothing stale.
  void clear() {
    copies_.clear();
    stale_ = false;
  }
  // A second backward ran before the step: .grad holds a sum the copies
  // are not; step() reduces from .grad.
  void mark_stale() { stale_ = true; }
  bool stale() const { return stale_; }
  void record(size_t group, int64_t index, const at::Tensor& grad) {
    copies_.push_back(Copy{group, index, grad, grad._version()});
  }
  // This rank's answer (the step agrees on it): every .grad is the tensor
  // its hook copied, unchanged since, and none was set where no hook fired.
  bool match(const std::vector<torch::optim::OptimizerParamGroup>& groups) const {
    if (stale_) {
      return false;
    }
    size_t with_grad = 0;
    for (const auto& group : groups) {
      for (const auto& param : group.params()) {
        with_grad += param.grad().defined() ? 1 : 0;
      }
    }
    if (with_grad != copies_.size()) {
      return false;
    }
    for (const Copy& copy : copies_) {
      const at::Tensor& now = groups[copy.group].params()[copy.index].grad();
      if (!now.is_same(copy.grad) || now._version() != copy.version) {
        return false;
      }
    }
    return true;
  }

 private:
  struct Copy {
    size_t group;
    int64_t index;
    at::Tensor grad;  // the .grad the hook copied
    int64_t version;  // its version counter then
  };
  std::vector<Copy> copies_;
  bool stale_ = false;
};

}  // namespace zeroshard
