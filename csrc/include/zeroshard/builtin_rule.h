// zeroshard::BuiltinRule: a built-in optimizer (Adam, AdamW, SGD:
// inner_optimizer.h) as an UpdateRule. An optimizer runs one kind of update,
// so a group with a rule of its own (Muon for the hidden matrices) and a
// group with AdamW (the rest) are both rules: the AdamW group runs the same
// kernels as a built-in AdamW optimizer, on its pieces of the shard.
//
//   std::vector<torch::optim::OptimizerParamGroup> groups;
//   groups.emplace_back(matrices,
//                       std::make_unique<RuleOptions>(MuonOptions().lr(2e-2).rule_options()));
//   groups.emplace_back(rest, std::make_unique<RuleOptions>(
//                                 builtin_rule_options(torch::optim::AdamWOptions(1e-3))));
//   ZeroOptimizer optimizer(groups, group, MuonOptions().rule_options(), ZeroOptions());
#pragma once

#include "zeroshard/inner_optimizer.h"
#include "zeroshard/update_rule.h"

#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

class BuiltinRule : public UpdateRule {
 public:
  // Adam, AdamW or SGD (not kRule).
  explicit BuiltinRule(InnerOptimizerKind kind);
  // torch's class name: a checkpoint of this group and one of the same group
  // running torch.optim.AdamW from Python load into each other.
  std::string name() const override;
  std::vector<std::string> state_names(const nlohmann::json& hyperparameters) const override;
  void validate(const nlohmann::json& hyperparameters) const override;
  void update(const nlohmann::json& hyperparameters, std::vector<ParameterShard>& shards) override;

 private:
  std::unique_ptr<torch::optim::OptimizerOptions> options_of(
      const nlohmann::json& hyperparameters) const;

  InnerOptimizerKind kind_;
};

// `options` (AdamOptions, AdamWOptions or SGDOptions) as a group's rule
// options: a BuiltinRule and the same values, with torch.optim's keys.
RuleOptions builtin_rule_options(const torch::optim::OptimizerOptions& options);

}  // namespace zeroshard
