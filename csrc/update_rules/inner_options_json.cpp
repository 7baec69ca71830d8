// Hyper-parameters to and from JSON, for checkpoints, and their defaults.
#include "zeroshard/inner_optimizer.h"
#include "zeroshard/update_rule.h"

#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <tuple>

namespace zeroshard {
namespace {

template <typename Options>
nlohmann::json adam_like_to_json(const Options& o) {
  return {{"lr", o.lr()},
          {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()},
          {"amsgrad", o.amsgrad()}};
}

template <typename Options>
void apply_adam_like(Options& o, const nlohmann::json& values) {
  o.lr(values.at("lr").get<double>());
  o.betas(
      std::make_tuple(values.at("betas")[0].get<double>(), values.at("betas")[1].get<double>()));
  o.eps(values.at("eps").get<double>());
  o.weight_decay(values.at("weight_decay").get<double>());
  o.amsgrad(values.at("amsgrad").get<bool>());
}

}  // namespace

std::unique_ptr<torch::optim::OptimizerOptions> default_inner_options(InnerOptimizerKind kind) {
  switch (kind) {
    case InnerOptimizerKind::kAdam:
      return std::make_unique<torch::optim::AdamOptions>();
    case InnerOptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamWOptions>();
    case InnerOptimizerKind::kSGD:
      return std::make_unique<torch::optim::SGDOptions>(kSgdDefaultLr);
    case InnerOptimizerKind::kRule:
      break;
  }
  TORCH_CHECK_VALUE(false, "an update rule has no default options: give its RuleOptions");
}

nlohmann::json inner_optimizer_defaults(InnerOptimizerKind kind) {
  return inner_options_to_json(kind, *default_inner_options(kind));
}

nlohmann::json inner_options_to_json(InnerOptimizerKind kind,
                                     const torch::optim::OptimizerOptions& options) {
  switch (kind) {
    case InnerOptimizerKind::kAdam:
      return adam_like_to_json(static_cast<const torch::optim::AdamOptions&>(options));
    case InnerOptimizerKind::kAdamW:
      return adam_like_to_json(static_cast<const torch::optim::AdamWOptions&>(options));
    case InnerOptimizerKind::kSGD: {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
      return {{"lr", o.lr()},
              {"momentum", o.momentum()},
              {"dampening", o.dampening()},
              {"weight_decay", o.weight_decay()},
              {"nesterov", o.nesterov()}};
    }
    case InnerOptimizerKind::kRule:
      return static_cast<const RuleOptions&>(options).hyperparameters();
  }
  return {};
}

void apply_inner_options_json(InnerOptimizerKind kind, torch::optim::OptimizerOptions& options,
                              const nlohmann::json& values) {
  switch (kind) {
    case InnerOptimizerKind::kAdam:
      apply_adam_like(static_cast<torch::optim::AdamOptions&>(options), values);
      break;
    case InnerOptimizerKind::kAdamW:
      apply_adam_like(static_cast<torch::optim::AdamWOptions&>(options), values);
      break;
    case InnerOptimizerKind::kSGD: {
      auto& o = static_cast<torch::optim::SGDOptions&>(options);
      o.lr(values.at("lr").get<double>());
      o.momentum(values.at("momentum").get<double>());
      o.dampening(values.at("dampening").get<double>());
      o.weight_decay(values.at("weight_decay").get<double>());
      o.nesterov(values.at("nesterov").get<bool>());
      break;
    }
    case InnerOptimizerKind::kRule:
      static_cast<RuleOptions&>(options).hyperparameters() = values;
      break;
  }
}

}  // namespace zeroshard
