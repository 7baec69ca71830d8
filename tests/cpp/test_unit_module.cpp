// Stage 3 from pure C++: a torch::nn model with UnitModule-wrapped layers
// trains on several ranks (threads, Gloo) to the parameters LibTorch's own
// AdamW reaches on the global batch.
#include "zeroshard/unit_module.h"

#include "zeroshard/gathered_parameters.h"

#include "rank_threads.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros_like.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <mutex>
#include <set>
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
      // Only the head (in no unit) stays gathered: its 3 bias floats, then
      // its 9*3 weight from the next 16-byte boundary ([Note: aligned
      // slots]), the bucket padded to a multiple of world x 4 floats.
      const int64_t bucket = (4 + 9 * 3 + 4 * world - 1) / (4 * world) * (4 * world);
      EXPECT_EQ(gathered_between_steps[rank], bucket * 4) << "rank " << rank;
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

// Data-dependent routing over UnitModule experts: each sample goes to the
// expert its router picks, so a rank runs only the experts its samples chose
// (some none, some twice as a rank may route a sample again), and the ranks
// agree on each gather ([Note: Negotiated collectives]).
constexpr int64_t kExperts = 4;

struct RoutedNetImpl : torch::nn::Module {
  RoutedNetImpl()
      : router(register_module("router", torch::nn::Linear(5, kExperts))),
        head(register_module("head", torch::nn::Linear(5, 3))) {
    for (int64_t e = 0; e < kExperts; ++e) {
      experts.push_back(
          register_module("expert" + std::to_string(e), make_unit(torch::nn::Linear(5, 5))));
    }
  }

  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor choice = router->forward(x).argmax(-1);
    at::Tensor out = at::zeros_like(x);
    ran.clear();
    for (int64_t e = 0; e < kExperts; ++e) {
      const at::Tensor rows = choice.eq(e).nonzero().squeeze(-1);
      if (rows.numel() == 0) {
        continue;
      }
      ran.insert(e);
      at::Tensor y = experts[e]->forward(x.index_select(0, rows)).tanh();
      // Samples whose first feature is positive pass through their expert again.
      const at::Tensor again = x.index_select(0, rows).select(1, 0).gt(0).nonzero().squeeze(-1);
      if (again.numel() > 0) {
        y = y.index_add(0, again, experts[e]->forward(y.index_select(0, again)));
      }
      out = out.index_add(0, rows, y);
    }
    return head->forward(out);
  }

  torch::nn::Linear router;
  torch::nn::Linear head;
  std::vector<UnitModule<torch::nn::Linear>> experts;
  std::set<int64_t> ran;  // experts the last forward ran
};
TORCH_MODULE(RoutedNet);

RoutedNet MakeRoutedNet() {
  RoutedNet net;
  auto generator = at::detail::createCPUGenerator(7);
  at::NoGradGuard no_grad;
  for (auto& p : net->parameters()) {
    p.copy_(at::randn(p.sizes(), generator) * 0.5);
  }
  return net;
}

std::pair<at::Tensor, at::Tensor> RoutedBatch(int step) {
  auto generator = at::detail::createCPUGenerator(900 + step);
  at::Tensor x = at::randn({kBatch, 5}, generator);
  return {x, at::randn({kBatch, 3}, generator)};
}

TEST(UnitModuleTest, StageThreeTrainsDataDependentRoutingLikeLibTorchAdamW) {
  RoutedNet reference = MakeRoutedNet();
  torch::optim::AdamW reference_optimizer(reference->parameters(),
                                          torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = RoutedBatch(step);
    reference_optimizer.zero_grad();
    (reference->forward(x) - y).pow(2).mean().backward();
    reference_optimizer.step();
  }
  const auto expected = reference->parameters();

  for (int world : {2, 3}) {
    std::mutex mutex;
    std::vector<std::vector<at::Tensor>> results(world);
    std::vector<std::vector<std::set<int64_t>>> ran(world);
    std::vector<int64_t> diverged(world, 0);
    const auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      RoutedNet net = MakeRoutedNet();
      ZeroOptimizer optimizer(net->parameters(), pg, torch::optim::AdamWOptions(1e-2),
                              ZeroOptions().stage(3).stage3_param_persistence_threshold(0),
                              collect_units(*net));
      attach_units(*net, optimizer);
      std::vector<std::set<int64_t>> ran_here;
      for (int step = 0; step < kSteps; ++step) {
        auto [x, y] = RoutedBatch(step);
        const int64_t per_rank = kBatch / world;
        optimizer.zero_grad();
        at::Tensor output;
        {
          ModelForward forward(optimizer);
          output = net->forward(x.narrow(0, rank * per_rank, per_rank));
        }
        ran_here.push_back(net->ran);
        (output - y.narrow(0, rank * per_rank, per_rank)).pow(2).mean().backward();
        optimizer.step();
      }
      std::vector<at::Tensor> snapshot;
      {
        GatheredParameters full(optimizer);
        for (const auto& p : net->parameters()) {
          snapshot.push_back(p.detach().clone());
        }
      }
      std::lock_guard<std::mutex> lock(mutex);
      results[rank] = std::move(snapshot);
      ran[rank] = std::move(ran_here);
      diverged[rank] = optimizer.diverged_agreements();
    });
    // The routing did differ between ranks, and each expert ran somewhere.
    bool some_rank_skipped_an_expert = false;
    std::set<int64_t> ran_anywhere;
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_EQ(errors[rank], "") << "world " << world << " rank " << rank;
      for (const auto& experts : ran[rank]) {
        some_rank_skipped_an_expert |= experts.size() < static_cast<size_t>(kExperts);
        ran_anywhere.insert(experts.begin(), experts.end());
      }
      EXPECT_GT(diverged[rank], 0) << "the ranks never asked for different gathers";
      double diff = 0;
      for (size_t i = 0; i < expected.size(); ++i) {
        diff = std::max(diff, (results[rank][i] - expected[i]).abs().max().item<double>());
      }
      EXPECT_LE(diff, 1e-6) << "world " << world << " rank " << rank;
    }
    EXPECT_TRUE(some_rank_skipped_an_expert);
    EXPECT_EQ(ran_anywhere.size(), static_cast<size_t>(kExperts));
  }
}

TEST(UnitModuleTest, ARankRunningAnExtraBackwardRaisesOnEveryRank) {
  const auto errors = RunRanks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    RoutedNet net = MakeRoutedNet();
    ZeroOptimizer optimizer(net->parameters(), pg, torch::optim::AdamWOptions(1e-2),
                            ZeroOptions().stage(3).stage3_param_persistence_threshold(0),
                            collect_units(*net));
    attach_units(*net, optimizer);
    auto [x, y] = RoutedBatch(0);
    for (int pass = 0; pass < (rank == 0 ? 2 : 1); ++pass) {
      at::Tensor output;
      {
        ModelForward forward(optimizer);
        output = net->forward(x.narrow(0, rank * 6, 6));
      }
      (output - y.narrow(0, rank * 6, 6)).pow(2).mean().backward();
    }
    optimizer.step();
  });
  for (const auto& error : errors) {
    EXPECT_NE(error.find("at step 0"), std::string::npos) << error;
    EXPECT_NE(error.find("same number of forward passes"), std::string::npos) << error;
    EXPECT_EQ(error.find("INTERNAL ASSERT"), std::string::npos) << error;
  }
}
#endif  // ZEROSHARD_WITH_GLOO

#ifdef ZEROSHARD_WITH_GLOO
TEST(UnitModuleTest, AttachUnitsGivesEveryRankTheFirstRanksBuffers) {
  // As DDP at construction: a buffer initialised differently on each rank
  // (an unseeded random init) would otherwise stay different.
  const auto errors = RunRanks(3, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    Net net = MakeNet();
    at::Tensor shift = net->register_buffer("shift", at::full({4}, rank + 1.0));
    at::Tensor mask = net->fc1->register_buffer("mask", at::full({3}, rank == 0, at::kBool));
    ZeroOptimizer optimizer(net->parameters(), pg, torch::optim::AdamWOptions(1e-2),
                            ZeroOptions().stage(3), collect_units(*net));
    attach_units(*net, optimizer);
    EXPECT_TRUE(shift.eq(1.0).all().item<bool>()) << "rank " << rank << ": " << shift;
    EXPECT_TRUE(mask.all().item<bool>()) << "rank " << rank << ": " << mask;
  });
  for (const auto& error : errors) {
    EXPECT_EQ(error, "");
  }
}

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
    // Released again: only the head stays, its bucket aligned and padded
    // to a multiple of 3 ranks x 4 floats ([Note: aligned slots]).
    EXPECT_EQ(optimizer.gathered_parameter_bytes(), 36 * 4);
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
