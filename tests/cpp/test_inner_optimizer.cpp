// The flat-shard math against LibTorch's torch::optim, the C++ port of
// torch.optim, on the same tensors.
#include "zeroshard/inner_optimizer.h"

#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

namespace zeroshard {
namespace {

constexpr int kSteps = 6;

template <typename TorchOptimizer, typename Options>
double MaxDiffAgainstLibTorch(InnerOptimizerKind kind, const Options& options) {
  at::manual_seed(3);
  at::Tensor initial = at::randn({37});
  std::vector<at::Tensor> grads;
  for (int i = 0; i < kSteps; ++i) {
    grads.push_back(at::randn({37}));
  }
  // Reference.
  at::Tensor param = initial.clone().set_requires_grad(true);
  TorchOptimizer reference({param}, options);
  for (const auto& grad : grads) {
    param.mutable_grad() = grad.clone();
    reference.step();
  }
  // Ours, on a flat shard.
  ShardView view{initial.clone(), at::Tensor(),    at::zeros({37}),
                 at::zeros({37}), at::zeros({37}), at::zeros({37})};
  for (int i = 0; i < kSteps; ++i) {
    view.grad = grads[i];
    apply_inner_update(kind, options, view, i + 1);
  }
  return (view.param - param.detach()).abs().max().item<double>();
}

TEST(InnerOptimizerTest, AdamWMatchesLibTorch) {
  auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).betas({0.8, 0.95});
  EXPECT_LE((MaxDiffAgainstLibTorch<torch::optim::AdamW>(InnerOptimizerKind::kAdamW, options)),
            1e-6);
}

TEST(InnerOptimizerTest, AdamWithAmsgradAndWeightDecayMatchesLibTorch) {
  auto options = torch::optim::AdamOptions(1e-2).weight_decay(0.05).amsgrad(true);
  EXPECT_LE((MaxDiffAgainstLibTorch<torch::optim::Adam>(InnerOptimizerKind::kAdam, options)), 1e-6);
}

TEST(InnerOptimizerTest, SgdNesterovMatchesLibTorch) {
  auto options = torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(1e-3);
  EXPECT_LE((MaxDiffAgainstLibTorch<torch::optim::SGD>(InnerOptimizerKind::kSGD, options)), 1e-6);
}

TEST(InnerOptimizerTest, SgdWithDampeningMatchesLibTorch) {
  auto options = torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.3);
  EXPECT_LE((MaxDiffAgainstLibTorch<torch::optim::SGD>(InnerOptimizerKind::kSGD, options)), 1e-6);
}

TEST(InnerOptimizerTest, FusedAdamWMatchesTheSingleTensorPath) {
  auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
  at::manual_seed(5);
  at::Tensor initial = at::randn({53});
  ShardView plain{initial.clone(), at::Tensor(),    at::zeros({53}),
                  at::zeros({53}), at::zeros({53}), at::Tensor()};
  ShardView fused{initial.clone(), at::Tensor(),    at::zeros({53}),
                  at::zeros({53}), at::zeros({53}), at::Tensor()};
  for (int step = 1; step <= kSteps; ++step) {
    at::Tensor grad = at::randn({53});
    plain.grad = grad;
    fused.grad = grad;
    apply_inner_update(InnerOptimizerKind::kAdamW, options, plain, step);
    apply_inner_update(InnerOptimizerKind::kAdamW, options, fused, step, /*fused=*/true);
  }
  EXPECT_LE((plain.param - fused.param).abs().max().item<double>(), 1e-6);
  EXPECT_GT((fused.param - initial).abs().max().item<double>(), 1e-3) << "it must move";
  EXPECT_THROW(apply_inner_update(InnerOptimizerKind::kSGD, torch::optim::SGDOptions(0.1), plain, 1,
                                  /*fused=*/true),
               c10::ValueError);
}

TEST(InnerOptimizerTest, ParsesNamesAndRejectsUnknownOnes) {
  EXPECT_EQ(parse_inner_optimizer("AdamW"), InnerOptimizerKind::kAdamW);
  EXPECT_EQ(parse_inner_optimizer("sgd"), InnerOptimizerKind::kSGD);
  try {
    parse_inner_optimizer("lamb");
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown optimizer 'lamb'"), std::string::npos);
  }
}

TEST(InnerOptimizerTest, ValidatesHyperParameters) {
  EXPECT_THROW(validate_inner_options(InnerOptimizerKind::kAdamW, torch::optim::AdamWOptions(-1.0)),
               c10::ValueError);
  EXPECT_THROW(validate_inner_options(InnerOptimizerKind::kAdam,
                                      torch::optim::AdamOptions(1e-3).betas({1.0, 0.9})),
               c10::ValueError);
  EXPECT_THROW(validate_inner_options(InnerOptimizerKind::kSGD,
                                      torch::optim::SGDOptions(0.1).nesterov(true)),
               c10::ValueError);
  EXPECT_NO_THROW(validate_inner_options(InnerOptimizerKind::kSGD,
                                         torch::optim::SGDOptions(0.1).momentum(0.5)));
}

}  // namespace
}  // namespace zeroshard
