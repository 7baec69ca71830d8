// zeroshard::MuonRule: torch.optim.Muon as a C++ UpdateRule (update_rule.h),
// for LibTorch programs: momentum, Newton-Schulz orthogonalisation of the
// whole 2-D update in bf16, and the learning-rate adjustment, op for op as
// torch.optim.Muon's single-tensor path, so a checkpoint of either loads
// into the other. Each matrix is updated whole by its owner ([Note: whole
// parameters] in partition_layout.h).
//
//   ZeroOptimizer muon(hidden_matrices, group, MuonOptions().lr(2e-2).rule_options(),
//                      ZeroOptions().stage(2));
#pragma once

#include "zeroshard/update_rule.h"

#include <torch/csrc/api/include/torch/arg.h>

#include <array>
#include <string>

namespace zeroshard {

// Newton-Schulz's quintic coefficients (a, b, c).
using NsCoefficients = std::array<double, 3>;

// torch.optim.Muon's hyper-parameters and defaults.
struct MuonOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.1;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(NsCoefficients, ns_coefficients) = {{3.4445, -4.775, 2.0315}};
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;
  // "" (torch's None: "original"), "original" or "match_rms_adamw".
  TORCH_ARG(std::string, adjust_lr_fn) = "";

  // TORCH_ARG leaves the struct private.
 public:
  // As a parameter group's options: a MuonRule and these values, with
  // torch.optim.Muon's keys.
  RuleOptions rule_options() const;
};

class MuonRule : public UpdateRule {
 public:
  // torch's name: checkpoints of torch.optim.Muon (Python) and of this rule
  // load into each other.
  std::string name() const override { return "torch.optim.Muon"; }
  std::vector<std::string> state_names(const nlohmann::json& hyperparameters) const override;
  void validate(const nlohmann::json& hyperparameters) const override;
  void check_parameter(const std::vector<int64_t>& sizes,
                       const nlohmann::json& hyperparameters) const override;
  bool whole_parameters(const nlohmann::json& /*hyperparameters*/) const override { return true; }
  // Newton-Schulz's multiply-adds: m * n * min(m, n) per iteration.
  double update_cost(const std::vector<int64_t>& sizes,
                     const nlohmann::json& hyperparameters) const override;
  void update(const nlohmann::json& hyperparameters, std::vector<ParameterShard>& shards) override;
};

}  // namespace zeroshard
