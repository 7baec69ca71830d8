// The tiny two-layer network the optimizer tests train, held as raw leaf
// tensors (no torch::nn needed), and its global batch: one definition for
// test_zero_optimizer, test_offload and test_update_rule.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/randn.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace zeroshard {

inline constexpr int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4 ranks

struct TinyModel {
  std::vector<at::Tensor> params;  // w1 [7,5], b1 [7], w2 [3,7], scale [1], unused [4]

  explicit TinyModel(uint64_t seed) {
    // A generator per call: ranks are threads, and the global one is shared.
    auto generator = at::detail::createCPUGenerator(seed);
    for (auto sizes : std::vector<std::vector<int64_t>>{{7, 5}, {7}, {3, 7}, {1}, {4}}) {
      params.push_back((at::randn(sizes, generator) * 0.5).set_requires_grad(true));
    }
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& target) const {
    at::Tensor h = (x.matmul(params[0].t()) + params[1]).tanh();
    return (h.matmul(params[2].t()) * params[3] - target).pow(2).mean();
  }
};

// Step `step`'s inputs [kGlobalBatch, 5] and targets [kGlobalBatch, 3]; a
// rank takes its rows.
inline std::pair<at::Tensor, at::Tensor> GlobalBatch(int step) {
  auto generator = at::detail::createCPUGenerator(100 + step);
  at::Tensor x = at::randn({kGlobalBatch, 5}, generator);
  return {x, at::randn({kGlobalBatch, 3}, generator)};
}

inline double MaxDiff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, (a[i].detach() - b[i].detach()).abs().max().item<double>());
  }
  return diff;
}

}  // namespace zeroshard
