// The C++ Engine reads DeepSpeed's JSON and drives a torch::nn model on
// several ranks (threads, Gloo): accumulation boundaries, the LR schedule and
// the result of LibTorch's AdamW on the global batch.
#include "zeroshard/engine.h"
#include "zeroshard/update_rule.h"

#include "rank_threads.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <mutex>

namespace zeroshard {
namespace {

constexpr int64_t kMicroBatch = 8;  // global, per micro-step
constexpr int kAccumulation = 2;
constexpr int kSteps = 4;

torch::nn::Linear MakeModel() {
  torch::nn::Linear model(6, 3);
  auto generator = at::detail::createCPUGenerator(11);
  at::NoGradGuard no_grad;
  for (auto& p : model->parameters()) {
    p.copy_(at::randn(p.sizes(), generator) * 0.3);
  }
  return model;
}

std::pair<at::Tensor, at::Tensor> Batch(int step, int micro) {
  auto generator = at::detail::createCPUGenerator(900 + 10 * step + micro);
  at::Tensor x = at::randn({kMicroBatch, 6}, generator);
  return {x, at::randn({kMicroBatch, 3}, generator)};
}

const char* kConfig = R"({
  "train_batch_size": 16, "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                              "warmup_num_steps": 3, "warmup_type": "linear"}},
  "zero_optimization": {"stage": 2},
  "gradient_clipping": 0.0,
  "steps_per_print": 2
})";

#ifdef ZEROSHARD_WITH_GLOO

// Reference: LibTorch AdamW with the linear warmup DeepSpeed's WarmupLR sets.
// DeepSpeed starts the scheduler at iteration -1 (lr = warmup_min_lr) and
// advances it after each optimizer step, so optimizer step n runs with
// iteration n - 1: lr = max_lr * max(0, n - 1) / warmup_num_steps.
std::pair<std::vector<at::Tensor>, std::vector<double>> TrainReference() {
  auto reference = MakeModel();
  torch::optim::AdamW reference_optimizer(reference->parameters(),
                                          torch::optim::AdamWOptions(0.01).weight_decay(0.0));
  std::vector<double> expected_lrs;
  for (int step = 0; step < kSteps; ++step) {
    const double lr = 0.01 * std::min(1.0, std::max(0, step - 1) / 3.0);
    expected_lrs.push_back(lr);
    static_cast<torch::optim::AdamWOptions&>(reference_optimizer.param_groups()[0].options())
        .lr(lr);
    reference_optimizer.zero_grad();
    for (int micro = 0; micro < kAccumulation; ++micro) {
      auto [x, y] = Batch(step, micro);
      ((reference->forward(x) - y).pow(2).mean() / kAccumulation).backward();
    }
    reference_optimizer.step();
  }
  return {reference->parameters(), expected_lrs};
}

// What one rank saw: its final parameters, the lr of each step, the steps.
struct EngineRun {
  std::vector<at::Tensor> params;
  std::vector<double> lrs;
  int64_t global_steps = 0;
};

EngineRun TrainEngineRank(int rank, int world, torch::nn::Linear& model, Engine& engine) {
  EngineRun run;
  for (int step = 0; step < kSteps; ++step) {
    run.lrs.push_back(engine.get_lr().front());
    for (int micro = 0; micro < kAccumulation; ++micro) {
      auto [x, y] = Batch(step, micro);
      const int64_t per_rank = kMicroBatch / world;
      at::Tensor loss = engine.forward([&] {
        return (model->forward(x.narrow(0, rank * per_rank, per_rank)) -
                y.narrow(0, rank * per_rank, per_rank))
            .pow(2)
            .mean();
      });
      engine.backward(loss);
      EXPECT_EQ(engine.step(), micro == kAccumulation - 1);
    }
  }
  for (const auto& p : model->parameters()) {
    run.params.push_back(p.detach().clone());
  }
  run.global_steps = engine.global_steps();
  EXPECT_TRUE(engine.last_telemetry().has_value());
  return run;
}

void ExpectRunsMatchReference(const std::vector<std::string>& errors,
                              const std::vector<EngineRun>& runs) {
  const auto [expected, expected_lrs] = TrainReference();
  for (size_t rank = 0; rank < runs.size(); ++rank) {
    ASSERT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_EQ(runs[rank].global_steps, kSteps);
    for (int step = 0; step < kSteps; ++step) {
      EXPECT_NEAR(runs[rank].lrs[step], expected_lrs[step], 1e-12) << "step " << step;
    }
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_LE((runs[rank].params[i] - expected[i]).abs().max().item<double>(), 1e-6);
    }
  }
}

TEST(EngineTest, TrainsFromDeepSpeedJsonLikeLibTorchWithTheSameSchedule) {
  constexpr int kWorld = 2;
  std::mutex mutex;
  std::vector<EngineRun> runs(kWorld);
  const auto errors = RunRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    const auto config = parse_deepspeed_config(nlohmann::json::parse(kConfig), kWorld);
    auto model = MakeModel();
    auto optimizer = make_optimizer(model->parameters(), pg, config);
    Engine engine(*optimizer, config);
    EngineRun run = TrainEngineRank(rank, kWorld, model, engine);
    std::lock_guard<std::mutex> lock(mutex);
    runs[rank] = std::move(run);
  });
  ExpectRunsMatchReference(errors, runs);
}

// zero_hpz_partition_size 2 on 4 ranks: two shard groups of 2, replicated.
TEST(EngineTest, ZeroHpzPartitionSizeTrainsAsHybridSharding) {
  constexpr int kWorld = 4;
  nlohmann::json json = nlohmann::json::parse(kConfig);
  json["zero_optimization"]["zero_hpz_partition_size"] = 2;
  const auto config = parse_deepspeed_config(json, kWorld);
  ASSERT_EQ(config.shard_group_size, 2);
  std::mutex mutex;
  std::vector<EngineRun> runs(kWorld);
  const auto errors = RunHybridRanks(kWorld, 2, [&](int rank, HybridGroups groups) {
    auto model = MakeModel();
    auto optimizer = make_optimizer(model->parameters(), groups.shard, groups.replicate, config);
    EXPECT_EQ(optimizer->data_parallel_world_size(), kWorld);
    Engine engine(*optimizer, config);
    EngineRun run = TrainEngineRank(rank, kWorld, model, engine);
    std::lock_guard<std::mutex> lock(mutex);
    runs[rank] = std::move(run);
  });
  ExpectRunsMatchReference(errors, runs);
  // The world group where the config asks for shard groups is refused.
  const auto refused = RunRanks(kWorld, [&](int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = MakeModel();
    make_optimizer(model->parameters(), pg, config);
  });
  for (const auto& error : refused) {
    EXPECT_NE(error.find("expects shard groups of 2 ranks and 2 replicas; got a shard group of 4 "
                         "ranks and 1 replicas"),
              std::string::npos)
        << error;
  }
}

// DeepSpeed's "Muon" from C++: make_optimizer over named parameters splits
// them as DeepSpeed does (the 2-D weight to Muon, the bias to its Adam) and
// trains as those two rules in one process: the Muon half's MuonRule on the
// weight (equal to torch.optim.Muon: test_muon.py), LibTorch's AdamW with the
// Adam half's values on the bias.
const char* kMuonConfig = R"({
  "train_batch_size": 16, "gradient_accumulation_steps": 2,
  "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.005, "weight_decay": 0.01}},
  "zero_optimization": {"stage": 2},
  "gradient_clipping": 0.0,
  "steps_per_print": 2
})";

TEST(EngineTest, DeepSpeedMuonOverNamedParametersTrainsAsItsTwoRulesInOneProcess) {
  constexpr int kWorld = 2;
  const auto config = parse_deepspeed_config(nlohmann::json::parse(kMuonConfig), kWorld);
  auto reference = MakeModel();
  const auto groups = deepspeed_muon_groups(reference->named_parameters().pairs(), config);
  ASSERT_EQ(groups.size(), 2u);
  ASSERT_EQ(groups[0].params().size(), 1u);
  ASSERT_EQ(groups[1].params().size(), 1u);
  EXPECT_TRUE(groups[0].params()[0].is_same(reference->weight));
  EXPECT_TRUE(groups[1].params()[0].is_same(reference->bias));
  const auto& muon = static_cast<const RuleOptions&>(groups[0].options());
  EXPECT_EQ(muon.rule()->name(), "torch.optim.Muon");
  EXPECT_EQ(muon.hyperparameters().at("adjust_lr_fn"), "original");
  EXPECT_TRUE(muon.hyperparameters().at("nesterov").get<bool>());
  EXPECT_DOUBLE_EQ(muon.hyperparameters().at("lr").get<double>(), 0.02);
  EXPECT_EQ(static_cast<const RuleOptions&>(groups[1].options()).rule()->name(),
            "torch.optim.AdamW");

  torch::optim::AdamW bias_optimizer(
      {reference->bias},
      torch::optim::AdamWOptions(0.005).betas({0.9, 0.95}).eps(1e-10).weight_decay(0.01));
  at::Tensor momentum = at::zeros_like(reference->weight);
  for (int step = 0; step < kSteps; ++step) {
    bias_optimizer.zero_grad();
    reference->weight.mutable_grad() = at::Tensor();
    for (int micro = 0; micro < kAccumulation; ++micro) {
      auto [x, y] = Batch(step, micro);
      ((reference->forward(x) - y).pow(2).mean() / kAccumulation).backward();
    }
    std::vector<ParameterShard> pieces(1);
    pieces[0].sizes = reference->weight.sizes().vec();
    pieces[0].step = step + 1;
    pieces[0].param = reference->weight.detach().view({-1});
    pieces[0].grad = reference->weight.grad().reshape({-1});
    pieces[0].states = {momentum.view({-1})};
    at::NoGradGuard no_grad;
    muon.rule()->update(muon.hyperparameters(), pieces);
    bias_optimizer.step();
  }

  std::mutex mutex;
  std::vector<EngineRun> runs(kWorld);
  const auto errors = RunRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = MakeModel();
    auto optimizer = make_optimizer(model->named_parameters().pairs(), pg, config);
    EXPECT_EQ(optimizer->param_groups().size(), 2u);
    Engine engine(*optimizer, config);
    EngineRun run = TrainEngineRank(rank, kWorld, model, engine);
    std::lock_guard<std::mutex> lock(mutex);
    runs[rank] = std::move(run);
  });
  const std::vector<at::Tensor> expected = reference->parameters();
  EXPECT_GT((expected[0] - MakeModel()->weight).abs().max().item<double>(), 1e-3);  // it trained
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_EQ(errors[rank], "") << "rank " << rank;
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_LE((runs[rank].params[i] - expected[i]).abs().max().item<double>(), 1e-6)
          << "rank " << rank << " parameter " << i;
    }
  }
  // A parameter DeepSpeed's rule picks that is not a matrix is refused, named.
  try {
    deepspeed_muon_groups({{"blocks.0.conv.weight", at::zeros({2, 2, 2})}}, config);
    ADD_FAILURE() << "a 3-D parameter was accepted";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("blocks.0.conv.weight has shape [2, 2, 2]"),
              std::string::npos)
        << error.what();
  }
  EXPECT_FALSE(uses_deepspeed_muon("model.embed_tokens.weight", 2));
  EXPECT_FALSE(uses_deepspeed_muon("LM_HEAD.weight", 2));
  EXPECT_TRUE(uses_deepspeed_muon("layers.0.mlp.weight", 2));
}

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
