// Stage 3 from pure C++: a torch::nn model with UnitModule-wrapped layers
// trains on several ranks (threads, Gloo) to the parameters LibTorch's own
// AdamW reaches on the global batch.
#include "zeroshard/unit_module.h"

#include "zeroshard/gathered_parameters.h"

#include "rank_threads.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <mutex>
#include <string>
#include <vector>

namespace zeroshard {
namespace {

constexpr int64_t kBatch = 12;
constexpr int kSteps = 6;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", make_unit(torch::nn::Linear(5, 9)))),
        fc2(register_module("fc2", make_unit(torch::nn::Linear(9, 9)))),
        head(register_module("head", torch::nn::Linear(9, 3))) {}

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = fc1->forward(x).tanh();
    h = fc2->forward(fc2->forward(h).tanh());  // called twice
    return head->forward(h);                   // not a unit: stays gathered
  }

  UnitModule<torch::nn::Linear> fc1;
  UnitModule<torch::nn::Linear> fc2;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

Net MakeNet() {
  Net net;
  auto generator = at::detail::createCPUGenerator(3);
  at::NoGradGuard no_grad;
  for (auto& p : net->parameters()) {
    p.copy_(at::randn(p.sizes(), generator) * 0.3);
  }
  return net;
}

std::pair<at::Tensor, at::Tensor> Batch(int step) {
  auto generator = at::detail::createCPUGenerator(500 + step);
  at::Tensor x = at::randn({kBatch, 5}, generator);
  return {x, at::randn({kBatch, 3}, generator)};
}

std::vector<at::Tensor> Snapshot(Net& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

#ifdef ZEROSHARD_WITH_GLOO

TEST(UnitModuleTest, StageThreeTrainsATorchNnModelLikeLibTorchAdamW) {
  Net reference = MakeNet();
  torch::optim::AdamW reference_optimizer(reference->parameters(),
                                          torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = Batch(step);
    reference_optimizer.zero_grad();
    (reference->forward(x) - y).pow(2).mean().backward();
    reference_optimizer.step();
  }
  const auto expected = Snapshot(reference);

  for (int world : {2, 3}) {
    std::mutex mutex;
    std::vector<std::vector<at::Tensor>> results(world);
    std::vector<int64_t> gathered_between_steps(world, -1);
    const auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      Net net = MakeNet();
      ZeroOptimizer optimizer(net->parameters(), pg, torch::optim::AdamWOptions(1e-2),
                              ZeroOptions().stage(3).stage3_param_persistence_threshold(0),
                              collect_units(*net));
      attach_units(*net, optimizer);
      for (int step = 0; step < kSteps; ++step) {
        auto [x, y] = Batch(step);
        const int64_t per_rank = kBatch / world;
        optimizer.zero_grad();
        (net->forward(x.narrow(0, rank * per_rank, per_rank)) -
         y.narrow(0, rank * per_rank, per_rank))
            .pow(2)
            .mean()
            .backward();
        optimizer.step();
      }
      const int64_t gathered = optimizer.gathered_parameter_bytes();
      std::vector<at::Tensor> snapshot;
      {
        GatheredParameters full(optimizer);
        snapshot = Snapshot(net);
      }
      std::lock_guard<std::mutex> lock(mutex);
      results[rank] = std::move(snapshot);
      gathered_between_steps[rank] = gathered;
    });
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_EQ(errors[rank], "") << "rank " << rank;
      double diff = 0;
      for (size_t i = 0; i < expected.size(); ++i) {
        diff = std::max(diff, (results[rank][i] - expected[i]).abs().max().item<double>());
      }
      EXPECT_LE(diff, 1e-6) << "world " << world << " rank " << rank;
      // Only the head (in no unit) stays gathered: 9*3 + 3 floats.
      EXPECT_EQ(gathered_between_steps[rank], (9 * 3 + 3) * 4) << "rank " << rank;
    }
  }
}

TEST(UnitModuleTest, ShardedButUnattachedModelFailsInsteadOfReadingFreedMemory) {
  const auto errors = RunRanks(2, [](int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    Net net = MakeNet();
    ZeroOptimizer optimizer(net->parameters(), pg, torch::optim::AdamWOptions(1e-2),
                            ZeroOptions().stage(3).stage3_param_persistence_threshold(0),
                            collect_units(*net));
    net->forward(at::randn({2, 5}));  // attach_units forgotten
  });
  for (const auto& error : errors) {
    EXPECT_NE(error.find("storage"), std::string::npos) << error;
  }
}

#endif  // ZEROSHARD_WITH_GLOO

#ifdef ZEROSHARD_WITH_GLOO
TEST(UnitModuleTest, GatheredParametersKeepsTheModifierRanksEdits) {
  const auto errors = RunRanks(3, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    Net net = MakeNet();
    ZeroOptimizer optimizer(net->parameters(), pg, torch::optim::AdamWOptions(1e-2),
                            ZeroOptions().stage(3).stage3_param_persistence_threshold(0),
                            collect_units(*net));
    attach_units(*net, optimizer);
    at::Tensor weight = net->fc2->inner()->weight;
    {
      GatheredParameters full(optimizer, {weight}, /*modifier_rank=*/1);
      if (rank == 1) {
        at::NoGradGuard no_grad;
        weight.fill_(0.5);
      }
    }
    EXPECT_EQ(optimizer.gathered_parameter_bytes(), (9 * 3 + 3) * 4);  // released again
    GatheredParameters full(optimizer, {weight});
    EXPECT_TRUE(weight.eq(0.5).all().item<bool>()) << "rank " << rank;
  });
  for (const auto& error : errors) {
    EXPECT_EQ(error, "");
  }
}
#endif  // ZEROSHARD_WITH_GLOO

TEST(UnitModuleTest, CollectUnitsNamesEachWrappedModuleWithItsParameters) {
  Net net = MakeNet();
  const auto units = collect_units(*net);
  ASSERT_EQ(units.size(), 2u);
  EXPECT_EQ(units[0].name, "fc1");
  EXPECT_EQ(units[1].name, "fc2");
  EXPECT_EQ(units[0].params.size(), 2u);
}

}  // namespace
}  // namespace zeroshard
