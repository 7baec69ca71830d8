#include "zeroshard/builtin_rule.h"

#include <c10/util/Exception.h>

#include <memory>

namespace zeroshard {

BuiltinRule::BuiltinRule(InnerOptimizerKind kind) : kind_(kind) {
  TORCH_CHECK_VALUE(kind != InnerOptimizerKind::kRule,
                    "BuiltinRule runs Adam, AdamW or SGD; a rule is its own UpdateRule");
}

std::string BuiltinRule::name() const {
  switch (kind_) {
    case InnerOptimizerKind::kAdam:
      return "torch.optim.Adam";
    case InnerOptimizerKind::kAdamW:
      return "torch.optim.AdamW";
    default:
      return "torch.optim.SGD";
  }
}

std::unique_ptr<torch::optim::OptimizerOptions> BuiltinRule::options_of(
    const nlohmann::json& hyperparameters) const {
  auto options = default_inner_options(kind_);
  apply_inner_options_json(kind_, *options, hyperparameters);
  return options;
}

std::vector<std::string> BuiltinRule::state_names(const nlohmann::json& hyperparameters) const {
  std::vector<std::string> names;
  for (OptimizerStateName state : inner_optimizer_states(kind_, *options_of(hyperparameters))) {
    names.emplace_back(optimizer_state_name(state));
  }
  return names;
}

void BuiltinRule::validate(const nlohmann::json& hyperparameters) const {
  validate_inner_options(kind_, *options_of(hyperparameters));
}

void BuiltinRule::update(const nlohmann::json& hyperparameters,
                         std::vector<ParameterShard>& shards) {
  const auto options = options_of(hyperparameters);
  const std::vector<OptimizerStateName> states = inner_optimizer_states(kind_, *options);
  for (ParameterShard& piece : shards) {
    ShardView view{piece.param, piece.grad, {}, {}, {}, {}};
    for (size_t i = 0; i < states.size(); ++i) {
      switch (states[i]) {
        case OptimizerStateName::kExpAvg:
          view.exp_avg = piece.states[i];
          break;
        case OptimizerStateName::kExpAvgSq:
          view.exp_avg_sq = piece.states[i];
          break;
        case OptimizerStateName::kMaxExpAvgSq:
          view.max_exp_avg_sq = piece.states[i];
          break;
        default:
          view.momentum_buffer = piece.states[i];
      }
    }
    apply_inner_update(kind_, *options, view, piece.step);
  }
}

RuleOptions builtin_rule_options(const torch::optim::OptimizerOptions& options) {
  const InnerOptimizerKind kind = inner_optimizer_kind_of(options);
  TORCH_CHECK_VALUE(kind != InnerOptimizerKind::kRule,
                    "builtin_rule_options takes AdamOptions, AdamWOptions or SGDOptions; these "
                    "are rule options already");
  return RuleOptions(std::make_shared<BuiltinRule>(kind), inner_options_to_json(kind, options));
}

}  // namespace zeroshard
