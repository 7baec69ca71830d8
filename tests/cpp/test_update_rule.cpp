// An UpdateRule of the user's (update_rule.h) in a LibTorch program: an
// Adagrad written against the interface trains on 2 and 3 Gloo ranks (ranks
// as threads) to LibTorch's torch::optim::Adagrad on the global batch, and
// its own state ("sum") is saved at 2 ranks and resumed at 3; a rule with
// states of shapes of their own resumes at other owners.
#include "zeroshard/builtin_rule.h"
#include "zeroshard/muon_rule.h"
#include "zeroshard/update_rule.h"
#include "zeroshard/zero_optimizer.h"

#ifdef ZEROSHARD_WITH_GLOO
#include "rank_threads.h"
#include "temp_directory.h"
#include "tiny_model.h"
#endif

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adagrad.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace zeroshard {
namespace {

// torch::optim::Adagrad's step, op for op, on pieces of parameters (its
// defaults: lr_decay 0, initial_accumulator_value 0, eps 1e-10).
class Adagrad : public UpdateRule {
 public:
  std::string name() const override { return "test.Adagrad"; }
  std::vector<std::string> state_names(const nlohmann::json&) const override { return {"sum"}; }
  void validate(const nlohmann::json& hyperparameters) const override {
    TORCH_CHECK_VALUE(hyperparameters.at("lr").get<double>() >= 0, "lr must be >= 0");
  }
  void update(const nlohmann::json& h, std::vector<ParameterShard>& shards) override {
    const double lr = h.at("lr").get<double>();
    const double weight_decay = h.at("weight_decay").get<double>();
    const double eps = h.at("eps").get<double>();
    for (ParameterShard& piece : shards) {
      at::Tensor grad = piece.grad;
      if (weight_decay != 0) {
        grad = grad.add(piece.param, weight_decay);
      }
      at::Tensor& sum = piece.states[0];
      sum.addcmul_(grad, grad, 1.0);
      piece.param.addcdiv_(grad, sum.sqrt().add_(eps), -lr);
    }
  }
};

std::vector<at::Tensor> LibTorchAdagrad(int steps) {
  TinyModel model(0);
  torch::optim::Adagrad optimizer(model.params,
                                  torch::optim::AdagradOptions(0.05).weight_decay(0.01));
  for (int step = 0; step < steps; ++step) {
    auto [x, target] = GlobalBatch(step);
    optimizer.zero_grad();
    model.loss(x, target).backward();
    optimizer.step();
  }
  return model.params;
}

RuleOptions AdagradOptions() {
  return RuleOptions(std::make_shared<Adagrad>(),
                     {{"lr", 0.05}, {"weight_decay", 0.01}, {"eps", 1e-10}});
}

// [Note: parameter states] from C++: a rule that keeps, per parameter, the
// running mean of its squared gradient over the last dimension ([m, 1] for
// a matrix, [1] for a vector), as Adafactor's row statistic, and divides
// each row's step by its root: it needs the parameter whole.
class RowScaledSgd : public UpdateRule {
 public:
  std::string name() const override { return "test.RowScaledSgd"; }
  std::vector<std::string> state_names(const nlohmann::json&) const override { return {}; }
  bool whole_parameters(const nlohmann::json&) const override { return true; }
  std::vector<ParameterStateSpec> parameter_states(const std::vector<int64_t>& sizes,
                                                   const nlohmann::json&) const override {
    std::vector<int64_t> rows = sizes;
    rows.back() = 1;
    return {{"row_var", rows}};
  }
  void update(const nlohmann::json& h, std::vector<ParameterShard>& shards) override {
    for (ParameterShard& piece : shards) {
      Step(h.at("lr").get<double>(), piece.param.view(piece.sizes), piece.grad.view(piece.sizes),
           piece.parameter_states.at(0));
    }
  }
  static void Step(double lr, at::Tensor param, const at::Tensor& grad, at::Tensor row_var) {
    row_var.mul_(0.9).add_(grad.square().mean(-1, /*keepdim=*/true), 0.1);
    param.sub_(grad / row_var.sqrt().add(1e-8), lr);
  }
};

std::vector<at::Tensor> RowScaledInOneProcess(int steps) {
  TinyModel model(0);
  std::vector<at::Tensor> rows;
  for (const at::Tensor& p : model.params) {
    std::vector<int64_t> sizes = p.sizes().vec();
    sizes.back() = 1;
    rows.push_back(at::zeros(sizes));
  }
  for (int step = 0; step < steps; ++step) {
    auto [x, target] = GlobalBatch(step);
    for (auto& p : model.params) {
      p.mutable_grad() = at::Tensor();
    }
    model.loss(x, target).backward();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < model.params.size(); ++i) {
      if (model.params[i].grad().defined()) {
        RowScaledSgd::Step(0.02, model.params[i], model.params[i].grad(), rows[i]);
      }
    }
  }
  return model.params;
}

RuleOptions RowScaledOptions() {
  return RuleOptions(std::make_shared<RowScaledSgd>(), {{"lr", 0.02}});
}

#ifdef ZEROSHARD_WITH_GLOO

void Train(int rank, int world, TinyModel& model, ZeroOptimizer& optimizer, int first, int last) {
  const int64_t per_rank = kGlobalBatch / world;
  for (int step = first; step < last; ++step) {
    auto [x, target] = GlobalBatch(step);
    optimizer.zero_grad();
    model.loss(x.narrow(0, rank * per_rank, per_rank), target.narrow(0, rank * per_rank, per_rank))
        .backward();
    optimizer.step();
  }
}

// Loads the checkpoint at `path` (saved after step 4) on 3 ranks and trains
// steps 4-8: every rank ends within 1e-6 of `expected`, one process's 8 steps.
void ExpectResumesAtThreeRanksAsOneTraining(const std::string& path, const RuleOptions& options,
                                            const ZeroOptions& zero,
                                            const std::vector<at::Tensor>& expected) {
  std::vector<double> diffs(3, -1);
  std::mutex mutex;
  auto resumed = RunRanks(3, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(7);  // other values: the load restores them
    ZeroOptimizer optimizer(model.params, pg, options, zero);
    optimizer.load_checkpoint(path);
    Train(rank, 3, model, optimizer, 4, 8);
    std::lock_guard<std::mutex> lock(mutex);
    diffs[rank] = MaxDiff(model.params, expected);
  });
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(resumed[rank], "") << "rank " << rank;
    EXPECT_GE(diffs[rank], 0.0);
    EXPECT_LE(diffs[rank], 1e-6) << "rank " << rank;
  }
}

class UpdateRuleTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(UpdateRuleTest, AnAdagradRuleTrainsAsLibTorchAdagrad) {
  const auto [world, stage] = GetParam();
  const auto expected = LibTorchAdagrad(8);
  std::vector<double> diffs(world, -1);
  std::mutex mutex;
  auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(rank);  // rank 0's values are broadcast
    // Buckets of 16 elements: parameters split across ranks and buckets.
    ZeroOptimizer optimizer(model.params, pg, AdagradOptions(),
                            ZeroOptions().stage(stage).reduce_bucket_size(16));
    Train(rank, world, model, optimizer, 0, 8);
    std::lock_guard<std::mutex> lock(mutex);
    diffs[rank] = MaxDiff(model.params, expected);
  });
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_GE(diffs[rank], 0.0);
    EXPECT_LE(diffs[rank], 1e-6) << "rank " << rank << " world " << world;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndStages, UpdateRuleTest,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Values(1, 2)));

TEST(UpdateRuleCheckpointTest, SavedAtTwoRanksResumesAtThreeAsOneTraining) {
  TempDirectory directory;
  const std::string path = directory.path() + "/ckpt";
  const auto expected = LibTorchAdagrad(8);
  auto saved = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, AdagradOptions(),
                            ZeroOptions().stage(2).reduce_bucket_size(16));
    Train(rank, 2, model, optimizer, 0, 4);
    optimizer.save_checkpoint(path);
  });
  for (const auto& error : saved) {
    ASSERT_EQ(error, "");
  }
  ExpectResumesAtThreeRanksAsOneTraining(path, AdagradOptions(),
                                         ZeroOptions().stage(1).reduce_bucket_size(16), expected);
}

// [Note: parameter states]: each owner holds its matrices' row statistics in
// their shape; saved at 2 ranks and stage 3, they resume at 3 ranks and
// stage 1 (other owners) as one training.
TEST(UpdateRuleCheckpointTest, ParameterStatesResumeAtOtherOwnersAsOneTraining) {
  TempDirectory directory;
  const std::string path = directory.path() + "/ckpt";
  const auto expected = RowScaledInOneProcess(8);
  EXPECT_GT(MaxDiff(TinyModel(0).params, expected), 1e-3);  // it trained
  std::vector<std::vector<int64_t>> shapes(2);
  auto saved = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, RowScaledOptions(),
                            ZeroOptions().stage(3).stage3_param_persistence_threshold(0));
    Train(rank, 2, model, optimizer, 0, 4);
    optimizer.save_checkpoint(path);
    const ZeroOptimizer::ParameterStatePart w1 = optimizer.parameter_state(0, 0);
    ASSERT_EQ(w1.states.size(), 1u);
    EXPECT_EQ(w1.states[0].first, "row_var");
    if (w1.numel > 0) {  // the owner: [7, 1]
      shapes[rank] = w1.states[0].second.sizes().vec();
    }
  });
  for (const auto& error : saved) {
    ASSERT_EQ(error, "");
  }
  EXPECT_EQ(shapes[0].empty() ? shapes[1] : shapes[0], (std::vector<int64_t>{7, 1}));
  ExpectResumesAtThreeRanksAsOneTraining(path, RowScaledOptions(), ZeroOptions().stage(1),
                                         expected);
}

// 'cpu' offload runs a rule on the host ([Note: a rule on the host]); NVMe
// swaps the built-in states only.
TEST(UpdateRuleErrorsTest, SwappingARuleToNvmeIsRefusedOnEveryRankNamingIt) {
  TempDirectory directory;
  auto errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptions options;
    options.offload_optimizer(
        OffloadOptions().device(OffloadDevice::kNVMe).nvme_path(directory.path()));
    ZeroOptimizer optimizer(model.params, pg, AdagradOptions(), options);
  });
  for (const auto& error : errors) {
    EXPECT_NE(error.find("test.Adagrad"), std::string::npos) << error;
    EXPECT_NE(error.find("device 'nvme'"), std::string::npos) << error;
  }
}

// The C++ Muon on 2 and 3 ranks at stages 1 and 2 (each matrix owned whole
// by one rank) gives what the same rule gives applied to whole matrices in
// one process with the global batch's gradients; test_muon.py checks the
// rule against torch.optim.Muon bit for bit.
std::vector<at::Tensor> MuonInOneProcess(const RuleOptions& options, int steps) {
  TinyModel model(0);
  std::vector<at::Tensor> matrices = {model.params[0], model.params[2]};
  std::vector<at::Tensor> momenta = {at::zeros_like(matrices[0]), at::zeros_like(matrices[1])};
  for (int step = 0; step < steps; ++step) {
    auto [x, target] = GlobalBatch(step);
    for (auto& p : model.params) {
      p.mutable_grad() = at::Tensor();
    }
    model.loss(x, target).backward();
    std::vector<ParameterShard> pieces;
    for (size_t i = 0; i < matrices.size(); ++i) {
      ParameterShard piece;
      piece.sizes = matrices[i].sizes().vec();
      piece.step = step + 1;
      piece.param = matrices[i].detach().view({-1});
      piece.grad = matrices[i].grad().reshape({-1});
      piece.states = {momenta[i].view({-1})};
      pieces.push_back(piece);
    }
    at::NoGradGuard no_grad;
    options.rule()->update(options.hyperparameters(), pieces);
  }
  return {model.params[0], model.params[2]};
}

TEST_P(UpdateRuleTest, TheCppMuonOwnsEachMatrixWholeAndMatchesOneProcess) {
  const auto [world, stage] = GetParam();
  const RuleOptions options = MuonOptions().lr(2e-2).adjust_lr_fn("match_rms_adamw").rule_options();
  const auto expected = MuonInOneProcess(options, 6);
  std::vector<double> diffs(world, -1);
  std::mutex mutex;
  auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    // The same values on every rank: the vectors, outside the optimizer, are
    // not broadcast.
    TinyModel model(0);
    // The matrices alone in the Muon optimizer; the vectors are left alone.
    std::vector<at::Tensor> matrices = {model.params[0], model.params[2]};
    ZeroOptimizer optimizer(matrices, pg, options, ZeroOptions().stage(stage));
    const int64_t per_rank = kGlobalBatch / world;
    for (int step = 0; step < 6; ++step) {
      auto [x, target] = GlobalBatch(step);
      optimizer.zero_grad();
      for (auto& p : model.params) {
        p.mutable_grad() = at::Tensor();
      }
      model
          .loss(x.narrow(0, rank * per_rank, per_rank), target.narrow(0, rank * per_rank, per_rank))
          .backward();
      optimizer.step();
    }
    std::lock_guard<std::mutex> lock(mutex);
    diffs[rank] = MaxDiff(matrices, expected);
  });
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_GE(diffs[rank], 0.0);
    EXPECT_LE(diffs[rank], 1e-6) << "rank " << rank << " world " << world;
  }
}

// Muon's recipe from C++: the matrices with MuonRule, the vectors with AdamW
// as a BuiltinRule, in one optimizer; one process runs the same MuonRule on
// the matrices and LibTorch's own AdamW on the vectors.
void ExpectMuonBesideAdamWMatchesOneProcess(int world, const ZeroOptions& zero) {
  const int stage = zero.stage();
  const RuleOptions muon = MuonOptions().lr(2e-2).rule_options();
  const torch::optim::AdamWOptions adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.05);
  constexpr int kSteps = 5;
  std::vector<at::Tensor> expected;
  {
    TinyModel model(0);
    std::vector<at::Tensor> momenta = {at::zeros_like(model.params[0]),
                                       at::zeros_like(model.params[2])};
    torch::optim::AdamW reference({model.params[1], model.params[3]}, adamw);
    for (int step = 0; step < kSteps; ++step) {
      auto [x, target] = GlobalBatch(step);
      reference.zero_grad();
      model.params[0].mutable_grad() = at::Tensor();
      model.params[2].mutable_grad() = at::Tensor();
      model.loss(x, target).backward();
      std::vector<ParameterShard> pieces;
      for (int i : {0, 2}) {
        ParameterShard piece;
        piece.sizes = model.params[i].sizes().vec();
        piece.step = step + 1;
        piece.param = model.params[i].detach().view({-1});
        piece.grad = model.params[i].grad().reshape({-1});
        piece.states = {momenta[i / 2].view({-1})};
        pieces.push_back(piece);
      }
      at::NoGradGuard no_grad;
      muon.rule()->update(muon.hyperparameters(), pieces);
      reference.step();
    }
    expected = model.params;
  }
  EXPECT_GT(MaxDiff(TinyModel(0).params, expected), 1e-3);  // it trained
  std::vector<double> diffs(world, -1);
  std::mutex mutex;
  auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{model.params[0], model.params[2]},
                        std::make_unique<RuleOptions>(muon));
    groups.emplace_back(std::vector<at::Tensor>{model.params[1], model.params[3]},
                        std::make_unique<RuleOptions>(builtin_rule_options(adamw)));
    ZeroOptimizer optimizer(groups, pg, muon, zero);
    const int64_t per_rank = kGlobalBatch / world;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, target] = GlobalBatch(step);
      optimizer.zero_grad();
      model
          .loss(x.narrow(0, rank * per_rank, per_rank), target.narrow(0, rank * per_rank, per_rank))
          .backward();
      optimizer.step();
    }
    std::lock_guard<std::mutex> lock(mutex);
    diffs[rank] = MaxDiff(model.params, expected);
  });
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_GE(diffs[rank], 0.0);
    EXPECT_LE(diffs[rank], 1e-6) << "rank " << rank << " world " << world << " stage " << stage;
  }
}

TEST_P(UpdateRuleTest, MuonBesideABuiltinAdamWGroupMatchesOneProcess) {
  const auto [world, stage] = GetParam();
  ExpectMuonBesideAdamWMatchesOneProcess(world, ZeroOptions().stage(stage));
}

// [Note: a rule on the host]: both groups' states in host memory.
TEST_P(UpdateRuleTest, MuonBesideAdamWWithCpuOffloadMatchesOneProcess) {
  const auto [world, stage] = GetParam();
  ExpectMuonBesideAdamWMatchesOneProcess(world, ZeroOptions().stage(stage).offload_optimizer(
                                                    OffloadOptions().device(OffloadDevice::kCPU)));
}

TEST(UpdateRuleErrorsTest, BuiltinRuleOptionsNameTheClassAndItsStates) {
  const RuleOptions amsgrad = builtin_rule_options(torch::optim::AdamWOptions().amsgrad(true));
  EXPECT_EQ(amsgrad.rule()->name(), "torch.optim.AdamW");
  EXPECT_EQ(amsgrad.rule()->state_names(amsgrad.hyperparameters()),
            (std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}));
  EXPECT_THROW(builtin_rule_options(MuonOptions().rule_options()), c10::ValueError);
}

// [Note: whole parameters]: the owners are balanced by the rule's work.
TEST(UpdateRuleErrorsTest, MuonCostsNewtonSchulzWorkOtherRulesTheirElements) {
  const RuleOptions muon = MuonOptions().rule_options();
  EXPECT_EQ(muon.rule()->update_cost({4, 6}, muon.hyperparameters()), 4.0 * 6.0 * 4.0);
  EXPECT_EQ(muon.rule()->update_cost({12, 8}, muon.hyperparameters()), 12.0 * 8.0 * 8.0);
  const RuleOptions adamw = builtin_rule_options(torch::optim::AdamWOptions());
  EXPECT_EQ(adamw.rule()->update_cost({4, 6}, adamw.hyperparameters()), 24.0);
}

TEST(UpdateRuleErrorsTest, AVectorInAMuonOptimizerIsRefusedOnEveryRank) {
  auto errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, MuonOptions().rule_options());
  });
  for (const auto& error : errors) {
    EXPECT_NE(error.find("Muon only supports 2D parameters"), std::string::npos) << error;
    EXPECT_NE(error.find("parameter 1 of group 0"), std::string::npos) << error;
  }
}

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
