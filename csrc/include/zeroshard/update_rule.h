// zeroshard::UpdateRule: an update rule of the user's, run on this rank's
// shard. The built-in rules (Adam, AdamW, SGD: inner_optimizer.h) are
// LibTorch options types; any other elementwise rule (RAdam, Adagrad, Lion,
// a torch.optim class from Python) is an UpdateRule behind RuleOptions:
//
//   auto rule = std::make_shared<MyAdagrad>();
//   ZeroOptimizer optimizer(params, group,
//                           RuleOptions(rule, {{"lr", 1e-2}, {"eps", 1e-10}}), options);
//
// [Note: elementwise rules on shards]
// A rank holds pieces of parameters (ShardSegment): a parameter may start on
// one rank and end on the next. A rule sees each piece as a 1-D tensor with
// its gradient and states, so only a rule whose update of an element depends
// on that element alone (and on per-parameter scalars such as the step
// count) gives the values single-process training gives. A rule that needs
// each parameter whole (Muon: Newton-Schulz on the 2-D update) says so
// (whole_parameters): its group is then laid out so that one rank owns each
// parameter entirely ([Note: whole parameters] in partition_layout.h), and
// its pieces are whole parameters, with their shapes.
#pragma once

#include "zeroshard/optimizer_states.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

// [Note: parameter states]
// A whole-parameter rule may keep states in shapes of their own instead of
// one element per parameter element: Adafactor's row and column statistics
// of a matrix ([m, 1] and [1, n]), its variance of a vector. The parameter's
// owner holds them (it holds the parameter whole), in the shapes the rule
// gives, on the tier that holds the shard's states; checkpoints store them
// as pieces of their own flattening, so they load at any world size and
// stage, wherever the parameter's owner is then.
struct ParameterStateSpec {
  std::string name;            // as for state_names: "row_var"
  std::vector<int64_t> sizes;  // its shape for this parameter
};

// One piece of one parameter that this rank updates in this step.
struct ParameterShard {
  size_t group = 0;
  int64_t parameter = 0;       // its index within the group
  int64_t param_offset = 0;    // the parameter's element this piece starts at
  std::vector<int64_t> sizes;  // the parameter's shape (a whole parameter's piece is all of it)
  // Updates of the parameter including this one: 1 the first time it has a
  // gradient (its states are then freshly zeroed: a rule with other initial
  // values sets them).
  int64_t step = 0;
  at::Tensor param;                // fp32 master values, 1-D, updated in place
  at::Tensor grad;                 // fp32, 1-D, averaged over the ranks
  std::vector<at::Tensor> states;  // state_names()' order, fp32, 1-D, updated in place
  // parameter_states()' order, fp32, in their shapes, updated in place (a
  // whole parameter's; zeros on its first step).
  std::vector<at::Tensor> parameter_states;
};

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  // What messages and checkpoints call it ("torch.optim.RAdam"); a
  // checkpoint's states load into a rule of the same name only.
  virtual std::string name() const = 0;
  // The fp32 states it keeps per element with these hyper-parameters
  // (torch.optim's names where it has them: "exp_avg", "sum").
  virtual std::vector<std::string> state_names(const nlohmann::json& hyperparameters) const = 0;
  // Throws, naming the value, for hyper-parameters out of range.
  virtual void validate(const nlohmann::json& /*hyperparameters*/) const {}
  // Throws, naming what is wrong, for a parameter of this shape it cannot
  // update (Muon takes matrices only): checked for every parameter when the
  // optimizer is built, on every rank, not at a step on its owner alone.
  virtual void check_parameter(const std::vector<int64_t>& /*sizes*/,
                               const nlohmann::json& /*hyperparameters*/) const {}
  // Whether each parameter must be updated whole by one rank ([Note:
  // elementwise rules on shards]).
  virtual bool whole_parameters(const nlohmann::json& /*hyperparameters*/) const { return false; }
  // A whole-parameter rule's work on one parameter of this shape, in any
  // unit shared by all its parameters: owners are balanced by it ([Note:
  // whole parameters]). The number of elements unless a rule says better
  // (Muon: Newton-Schulz's m * n * min(m, n)).
  virtual double update_cost(const std::vector<int64_t>& sizes,
                             const nlohmann::json& /*hyperparameters*/) const;
  // A whole-parameter rule's states of a shape of their own for a parameter
  // of these sizes ([Note: parameter states]); none by default.
  virtual std::vector<ParameterStateSpec> parameter_states(
      const std::vector<int64_t>& /*sizes*/, const nlohmann::json& /*hyperparameters*/) const {
    return {};
  }
  // One step of the pieces that have a gradient this step, in offset order.
  virtual void update(const nlohmann::json& hyperparameters,
                      std::vector<ParameterShard>& shards) = 0;
};

// A parameter group's options for a rule: the rule and its hyper-parameters
// as JSON (numbers, booleans, arrays of numbers; "lr" is the learning rate
// schedulers read and write).
class RuleOptions : public torch::optim::OptimizerCloneableOptions<RuleOptions> {
 public:
  explicit RuleOptions(std::shared_ptr<UpdateRule> rule,
                       nlohmann::json hyperparameters = nlohmann::json::object());

  const std::shared_ptr<UpdateRule>& rule() const { return rule_; }
  const nlohmann::json& hyperparameters() const { return hyperparameters_; }
  nlohmann::json& hyperparameters() { return hyperparameters_; }

  double get_lr() const override;
  void set_lr(double lr) override;

 private:
  std::shared_ptr<UpdateRule> rule_;
  nlohmann::json hyperparameters_;
};

// The states of `options`' rule as registered names ([Note: open state
// names] in optimizer_states.h).
std::vector<OptimizerStateName> rule_states(const RuleOptions& options);

}  // namespace zeroshard
