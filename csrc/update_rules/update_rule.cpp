#include "zeroshard/update_rule.h"

#include <c10/util/Exception.h>

namespace zeroshard {

RuleOptions::RuleOptions(std::shared_ptr<UpdateRule> rule, nlohmann::json hyperparameters)
    : rule_(std::move(rule)), hyperparameters_(std::move(hyperparameters)) {
  TORCH_CHECK_VALUE(rule_ != nullptr, "RuleOptions needs an update rule; got a null one");
  TORCH_CHECK_VALUE(hyperparameters_.is_object(), "the hyper-parameters of update rule '",
                    rule_->name(), "' must be a JSON object; got ", hyperparameters_.dump());
}

double UpdateRule::update_cost(const std::vector<int64_t>& sizes,
                               const nlohmann::json& /*hyperparameters*/) const {
  double numel = 1;
  for (int64_t size : sizes) {
    numel *= static_cast<double>(size);
  }
  return numel;
}

double RuleOptions::get_lr() const {
  TORCH_CHECK_VALUE(hyperparameters_.contains("lr") && hyperparameters_.at("lr").is_number(),
                    "update rule '", rule_->name(), "' has no numeric \"lr\" hyper-parameter");
  return hyperparameters_.at("lr").get<double>();
}

void RuleOptions::set_lr(double lr) { hyperparameters_["lr"] = lr; }

std::vector<OptimizerStateName> rule_states(const RuleOptions& options) {
  std::vector<OptimizerStateName> out;
  for (const std::string& name : options.rule()->state_names(options.hyperparameters())) {
    TORCH_CHECK_VALUE(name != "master", "update rule '", options.rule()->name(),
                      "' names a state \"master\": that name is the fp32 master weights'");
    out.push_back(optimizer_state_named(name));
  }
  return out;
}

}  // namespace zeroshard
