// ZeroOptimizer on several ranks, as threads of one process meeting over a
// HashStore with real Gloo process groups (as PyTorch's own c10d C++ tests
// do), checked against LibTorch's torch::optim on the global batch.
#include "zeroshard/communicator.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/zero_optimizer.h"

#ifdef ZEROSHARD_WITH_GLOO
#include "rank_threads.h"
#include "temp_directory.h"
#include "tiny_model.h"
#endif

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/utils/clip_grad.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/api/include/torch/serialize/input-archive.h>
#include <torch/csrc/api/include/torch/serialize/output-archive.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace zeroshard {
namespace {

constexpr int kSteps = 8;

#ifdef ZEROSHARD_WITH_GLOO

std::vector<at::Tensor> TrainReference(const torch::optim::OptimizerOptions& options,
                                       double max_norm = 0) {
  TinyModel model(/*seed=*/0);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    optimizer = std::make_unique<torch::optim::AdamW>(model.params, *adamw);
  } else {
    optimizer = std::make_unique<torch::optim::SGD>(
        model.params, static_cast<const torch::optim::SGDOptions&>(options));
  }
  for (int step = 0; step < kSteps; ++step) {
    auto [x, target] = GlobalBatch(step);
    optimizer->zero_grad();
    model.loss(x, target).backward();
    if (max_norm > 0) {
      torch::nn::utils::clip_grad_norm_(model.params, max_norm);
    }
    optimizer->step();
  }
  return model.params;
}

void TrainRank(int rank, int world, TinyModel& model, ZeroOptimizer& optimizer, int first,
               int last) {
  const int64_t per_rank = kGlobalBatch / world;
  for (int step = first; step < last; ++step) {
    auto [x, target] = GlobalBatch(step);
    optimizer.zero_grad();
    model.loss(x.narrow(0, rank * per_rank, per_rank), target.narrow(0, rank * per_rank, per_rank))
        .backward();
    optimizer.step();
  }
}

class ZeroOptimizerTest : public ::testing::TestWithParam<int> {};

TEST_P(ZeroOptimizerTest, MatchesLibTorchAdamWAndSgdAfterEightSteps) {
  const int world = GetParam();
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true);
  for (const torch::optim::OptimizerOptions* options :
       std::initializer_list<const torch::optim::OptimizerOptions*>{&adamw, &sgd}) {
    const auto expected = TrainReference(*options);
    std::vector<double> diffs(world, -1);
    std::mutex mutex;
    auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      TinyModel model(/*seed=*/rank);  // rank 0's values are broadcast
      // A bucket of 16 elements: several buckets, parameters split across ranks.
      ZeroOptimizer optimizer(model.params, pg, *options,
                              ZeroOptions().stage(1).reduce_bucket_size(16));
      TrainRank(rank, world, model, optimizer, 0, kSteps);
      std::lock_guard<std::mutex> lock(mutex);
      diffs[rank] = MaxDiff(model.params, expected);
    });
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_EQ(errors[rank], "") << "rank " << rank;
      EXPECT_GE(diffs[rank], 0.0);
      EXPECT_LE(diffs[rank], 1e-6) << "rank " << rank << " world " << world;
    }
  }
}

// Hybrid sharding, 4 ranks as 2 shard groups of 2: the same result as
// LibTorch on the global batch, at every stage (stage 3 with every parameter
// in one unit), with identical parameters on the replicas, and only the
// gradient shards (plus the step's flags) crossing the replicas.
TEST(ZeroOptimizerHybridTest, TwoShardGroupsOfTwoMatchLibTorchAtEveryStage) {
  constexpr int kWorld = 4;
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  const auto expected = TrainReference(adamw, /*max_norm=*/0.3);
  for (int stage : {1, 2, 3}) {
    std::vector<double> diffs(kWorld, -1);
    std::vector<int64_t> replica_bytes(kWorld, -1);
    std::vector<int64_t> replica_gathers(kWorld, -1);
    std::vector<int64_t> shard_numel(kWorld, -1);
    std::vector<std::vector<at::Tensor>> finals(kWorld);
    std::mutex mutex;
    auto errors = RunHybridRanks(kWorld, /*shard_size=*/2, [&](int rank, HybridGroups groups) {
      TinyModel model(/*seed=*/rank);  // global rank 0's values are broadcast
      std::vector<ParameterUnit> units;
      if (stage == 3) {
        units.push_back(ParameterUnit{"model", model.params});
      }
      ZeroOptimizer optimizer({torch::optim::OptimizerParamGroup(model.params)}, groups.shard,
                              groups.replicate, adamw,
                              ZeroOptions()
                                  .stage(stage)
                                  .reduce_bucket_size(16)
                                  .max_norm(0.3)
                                  .stage3_param_persistence_threshold(0),
                              units);
      EXPECT_EQ(optimizer.data_parallel_world_size(), kWorld);
      for (int step = 0; step < kSteps; ++step) {
        auto [x, target] = GlobalBatch(step);
        const int64_t per_rank = kGlobalBatch / kWorld;
        optimizer.zero_grad();
        if (step == kSteps - 1) {
          optimizer.replica_communicator()->reset_stats();
        }
        if (stage == 3) {
          optimizer.unit_pre_forward(0);  // no module hooks here: the unit by hand
        }
        model
            .loss(x.narrow(0, rank * per_rank, per_rank),
                  target.narrow(0, rank * per_rank, per_rank))
            .backward();
        if (stage == 3) {
          optimizer.unit_post_forward(0);  // held through backward, released now
        }
        optimizer.step();
      }
      const CommStats stats = optimizer.replica_communicator()->stats();
      // Rank 0 of each shard group gets the full values.
      std::vector<at::Tensor> values = optimizer.full_parameters(0).at(0);
      std::lock_guard<std::mutex> lock(mutex);
      diffs[rank] = values.empty() ? 0.0 : MaxDiff(values, expected);
      finals[rank] = values;
      replica_bytes[rank] = stats.all_reduce_bytes;
      replica_gathers[rank] = stats.all_gather_bytes + stats.reduce_scatter_bytes;
      shard_numel[rank] = optimizer.layout().group(0).shard_numel();
    });
    for (int rank = 0; rank < kWorld; ++rank) {
      EXPECT_EQ(errors[rank], "") << "stage " << stage << " rank " << rank;
      EXPECT_GE(diffs[rank], 0.0);
      EXPECT_LE(diffs[rank], 1e-6) << "stage " << stage << " rank " << rank;
      // The last step: the fp32 gradient shard and the 5 + 4 presence,
      // overflow and detached-parameter flags and the hyper-parameters' hash
      // and its complement (int32), nothing else.
      EXPECT_EQ(replica_bytes[rank], 4 * shard_numel[rank] + 4 * (5 + 4))
          << "stage " << stage << " rank " << rank;
      EXPECT_EQ(replica_gathers[rank], 0) << "stage " << stage << " rank " << rank;
    }
    // Both replicas' shard-group rank 0 (global ranks 0 and 2) hold the same values.
    ASSERT_EQ(finals[0].size(), 5u);
    ASSERT_EQ(finals[2].size(), 5u);
    EXPECT_EQ(MaxDiff(finals[2], finals[0]), 0.0) << "stage " << stage;
  }
}

// A parameter only rank 0 uses, in the model's one bucket: the other rank
// completes no bucket in the first round (that hung: only ranks that had
// completed one took part in the bucket-order broadcast).
TEST(ZeroOptimizerErrorsTest, ParameterUsedOnOneRankOnlyTrainsAtStagesOneAndTwo) {
  constexpr int kWorld = 2;
  auto adamw = torch::optim::AdamWOptions(1e-2);
  TinyModel reference(/*seed=*/0);
  torch::optim::AdamW reference_optimizer(reference.params, adamw);
  const int64_t per_rank = kGlobalBatch / kWorld;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, target] = GlobalBatch(step);
    reference_optimizer.zero_grad();
    // The mean of the ranks' losses; only rank 0's holds the extra term.
    (reference.loss(x, target) + reference.params[4].pow(2).sum() / kWorld).backward();
    reference_optimizer.step();
  }
  for (int stage : {1, 2}) {
    std::vector<double> diffs(kWorld, -1);
    std::mutex mutex;
    auto errors = RunRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      TinyModel model(/*seed=*/0);
      ZeroOptimizer optimizer(model.params, pg, adamw, ZeroOptions().stage(stage));
      for (int step = 0; step < kSteps; ++step) {
        auto [x, target] = GlobalBatch(step);
        optimizer.zero_grad();
        at::Tensor loss = model.loss(x.narrow(0, rank * per_rank, per_rank),
                                     target.narrow(0, rank * per_rank, per_rank));
        if (rank == 0) {
          loss = loss + model.params[4].pow(2).sum();
        }
        loss.backward();
        optimizer.step();
      }
      std::lock_guard<std::mutex> lock(mutex);
      diffs[rank] = MaxDiff(model.params, reference.params);
    });
    for (int rank = 0; rank < kWorld; ++rank) {
      EXPECT_EQ(errors[rank], "") << "stage " << stage << " rank " << rank;
      EXPECT_GE(diffs[rank], 0.0);
      EXPECT_LE(diffs[rank], 1e-6) << "stage " << stage << " rank " << rank;
    }
  }
}

TEST_P(ZeroOptimizerTest, SaveLoadContinueEqualsUninterrupted) {
  const int world = GetParam();
  auto options = torch::optim::AdamWOptions(1e-2);
  std::vector<double> diffs(world, -1);
  auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel straight(0);
    ZeroOptimizer straight_optimizer(straight.params, pg, options);
    TrainRank(rank, world, straight, straight_optimizer, 0, kSteps);

    TinyModel first(0);
    ZeroOptimizer first_optimizer(first.params, pg, options);
    TrainRank(rank, world, first, first_optimizer, 0, kSteps / 2);
    ShardState saved = first_optimizer.shard_state();

    TinyModel resumed(42);  // other values: the load must restore them
    ZeroOptimizer resumed_optimizer(resumed.params, pg, options);
    resumed_optimizer.load_shard_state(saved);
    TrainRank(rank, world, resumed, resumed_optimizer, kSteps / 2, kSteps);
    diffs[rank] = MaxDiff(resumed.params, straight.params);
  });
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(errors[rank], "");
    EXPECT_EQ(diffs[rank], 0.0) << "rank " << rank;
  }
}

TEST_P(ZeroOptimizerTest, TorchSaveAndLoadArchivesResumeExactly) {
  const int world = GetParam();
  auto options = torch::optim::AdamWOptions(1e-2);
  std::vector<double> diffs(world, -1);
  std::vector<double> lrs(world, -1);
  auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel straight(0);
    ZeroOptimizer straight_optimizer(straight.params, pg, options, ZeroOptions().stage(2));
    TrainRank(rank, world, straight, straight_optimizer, 0, kSteps);

    TinyModel first(0);
    ZeroOptimizer first_optimizer(first.params, pg, options, ZeroOptions().stage(2));
    TrainRank(rank, world, first, first_optimizer, 0, kSteps / 2);
    first_optimizer.param_groups()[0].options().set_lr(1e-2);  // what the archive restores
    torch::serialize::OutputArchive out;
    first_optimizer.save(out);
    std::ostringstream bytes;
    out.save_to(bytes);

    TinyModel resumed(42);
    auto other = torch::optim::AdamWOptions(5.0);  // overwritten by the archive
    ZeroOptimizer resumed_optimizer(resumed.params, pg, other, ZeroOptions().stage(2));
    torch::serialize::InputArchive in;
    std::istringstream source(bytes.str());
    in.load_from(source);
    resumed_optimizer.load(in);
    lrs[rank] = resumed_optimizer.param_groups()[0].options().get_lr();
    TrainRank(rank, world, resumed, resumed_optimizer, kSteps / 2, kSteps);
    diffs[rank] = MaxDiff(resumed.params, straight.params);
  });
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(errors[rank], "");
    EXPECT_EQ(lrs[rank], 1e-2);
    EXPECT_EQ(diffs[rank], 0.0) << "rank " << rank;
  }
}

TEST_P(ZeroOptimizerTest, OptimizerStateIsDividedByWorldSize) {
  const int world = GetParam();
  std::vector<int64_t> bytes(world, 0);
  auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, torch::optim::AdamWOptions(1e-3));
    bytes[rank] = optimizer.optimizer_state_bytes();
  });
  // Reversed, each slot on a 4-element (16-byte) boundary ([Note: aligned
  // slots]): 4 at 0, 1 at 4, 21 at 8, 7 at 32, 35 at 40, so 75 elements for
  // the 68 of the model, in one bucket padded to a multiple of world x 4.
  const int64_t aligned_end = 75;
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(errors[rank], "");
    const int64_t padded = (aligned_end + 4 * world - 1) / (4 * world) * 4;  // per rank
    // fp32 parameters: the master values are the parameter shard itself.
    EXPECT_EQ(bytes[rank], padded * 2 * 4) << "exp_avg, exp_avg_sq";
  }
}

TEST_P(ZeroOptimizerTest, StageTwoWithClippingMatchesLibTorch) {
  const int world = GetParam();
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  for (double max_norm : {0.0, 0.05}) {
    const auto expected = TrainReference(adamw, max_norm);
    std::vector<double> diffs(world, -1);
    std::vector<int> grads_left(world, -1);
    std::mutex mutex;
    auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      TinyModel model(/*seed=*/rank);
      ZeroOptimizer optimizer(model.params, pg, adamw,
                              ZeroOptions().stage(2).reduce_bucket_size(16).max_norm(max_norm));
      TrainRank(rank, world, model, optimizer, 0, kSteps);
      // After a backward, stage 2 leaves no full gradient behind.
      auto [x, target] = GlobalBatch(0);
      model.loss(x, target).backward();
      int left = 0;
      for (const auto& p : model.params) {
        left += p.grad().defined() ? 1 : 0;
      }
      optimizer.zero_grad();
      std::lock_guard<std::mutex> lock(mutex);
      diffs[rank] = MaxDiff(model.params, expected);
      grads_left[rank] = left;
    });
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_EQ(errors[rank], "") << "rank " << rank;
      EXPECT_GE(diffs[rank], 0.0);
      EXPECT_LE(diffs[rank], 1e-6) << "rank " << rank << " max_norm " << max_norm;
      EXPECT_EQ(grads_left[rank], 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ZeroOptimizerTest, ::testing::Values(2, 3));

TEST(ZeroOptimizerErrorsTest, ADifferentLrOnOneRankFailsOnEveryRankNamingEachRanksValue) {
  // At construction (one all-reduce of every option's and hyper-parameter's
  // extremes), and at the step after one rank changed it (the step's flags
  // carry their hash).
  const std::string named = "rank 0: group 0 lr = 0.001; rank 1: group 0 lr = 0.002";
  auto errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, torch::optim::AdamWOptions(rank == 0 ? 1e-3 : 2e-3));
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(errors[rank].find(named), std::string::npos) << errors[rank];
  }
  errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, torch::optim::AdamWOptions(1e-3),
                            ZeroOptions().stage(2));
    const at::Tensor before = model.params[0].detach().clone();
    auto [x, target] = GlobalBatch(0);
    model.loss(x, target).backward();
    if (rank == 1) {
      static_cast<torch::optim::AdamWOptions&>(optimizer.param_groups()[0].options()).lr(2e-3);
    }
    try {
      optimizer.step();
    } catch (...) {
      EXPECT_TRUE(model.params[0].equal(before)) << "rank " << rank << " updated";
      throw;
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(errors[rank].find("step() refused: the ranks' hyper-parameters differ (" + named),
              std::string::npos)
        << errors[rank];
  }
}

TEST(ZeroOptimizerErrorsTest, StateFromAnotherWorldSizeFailsOnEveryRank) {
  std::vector<ShardState> saved(3);
  auto save_errors = RunRanks(3, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, torch::optim::AdamWOptions(1e-3));
    saved[rank] = optimizer.shard_state();
  });
  auto errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, torch::optim::AdamWOptions(1e-3));
    optimizer.load_shard_state(saved[rank]);
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(errors[rank].find("saved by a run with world size 3 but this run has world size 2"),
              std::string::npos)
        << errors[rank];
  }
}

TEST(ZeroOptimizerErrorsTest, BadFileOnOneRankFailsOnEveryRank) {
  auto errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, torch::optim::AdamWOptions(1e-3));
    ShardState state = optimizer.shard_state();
    if (rank == 1) {
      state.pop_back();  // drop a key: only rank 1's file is bad
    }
    optimizer.load_shard_state(state);
  });
  EXPECT_NE(errors[0].find("another rank failed to load"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("is missing or has the wrong size"), std::string::npos) << errors[1];
  // The rank that did not fail is told which one did, and why.
  EXPECT_NE(errors[0].find("rank 1: "), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("is missing or has the wrong size"), std::string::npos) << errors[0];
}

// Expert parallelism on 4 ranks: expert e (values and gradients of its own)
// is sharded over ranks {2e, 2e + 1}; ranks {0, 2} and {1, 3} are the
// expert-parallel groups. The clipping norm counts both experts, and a
// non-finite gradient in one expert skips the step on every rank.
TEST(ZeroOptimizerExpertParallelTest, NormSpansTheExpertsAndOneOverflowSkipsEveryRank) {
  constexpr double kMaxNorm = 1.0;
  auto errors = RunHybridRanks(4, /*shard_size=*/2, [&](int rank, HybridGroups groups) {
    const int expert = rank / 2;
    const double local = rank % 2;
    std::vector<at::Tensor> params = {at::full({5}, expert + 1.0).set_requires_grad(true),
                                      at::full({3}, -expert - 1.0).set_requires_grad(true)};
    ZeroOptimizer optimizer(params, groups.shard, torch::optim::SGDOptions(1.0),
                            ZeroOptions().stage(1).skip_nonfinite_steps(true));
    optimizer.set_expert_parallel(groups.replicate);
    ASSERT_EQ(optimizer.model_parallel(), ZeroOptimizer::ModelParallel::kExpert);
    auto set_grads = [&](double value) {
      for (const at::Tensor& param : params) {
        param.mutable_grad() = at::full_like(param, value);
      }
    };
    // Expert e's averaged gradient is (e + 1) * 1.5 in all 8 elements.
    set_grads((expert + 1.0) * (local + 1.0));
    const double norm = optimizer.clip_grad_norm(kMaxNorm).item<double>();
    const double expected_norm = std::sqrt(8 * 2.25 * (1.0 + 4.0));
    EXPECT_NEAR(norm, expected_norm, 1e-5);
    optimizer.step();
    ASSERT_FALSE(optimizer.last_step_skipped());
    const double step = (expert + 1.0) * 1.5 * kMaxNorm / (expected_norm + 1e-6);
    EXPECT_NEAR(params[0][0].item<double>(), expert + 1.0 - step, 1e-6);
    EXPECT_NEAR(params[1][0].item<double>(), -expert - 1.0 - step, 1e-6);

    const at::Tensor before = params[0].detach().clone();
    optimizer.zero_grad();
    set_grads(expert == 1 && local == 0 ? std::nan("") : 1.0);
    optimizer.step();
    EXPECT_TRUE(optimizer.last_step_skipped()) << "rank " << rank;
    EXPECT_TRUE(at::equal(params[0].detach(), before)) << "rank " << rank;
  });
  for (const std::string& error : errors) {
    EXPECT_EQ(error, "");
  }
}

TEST(ZeroOptimizerErrorsTest, DuplicateParameterAndBadStageFailOnEveryRank) {
  auto errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{model.params[0], model.params[1]});
    groups.emplace_back(std::vector<at::Tensor>{model.params[1]});
    ZeroOptimizer optimizer(groups, pg, torch::optim::AdamWOptions(1e-3));
  });
  for (const auto& error : errors) {
    EXPECT_NE(error.find("some parameters appear more than once"), std::string::npos) << error;
  }
  errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(model.params, pg, torch::optim::AdamWOptions(1e-3),
                            ZeroOptions().stage(0));
  });
  for (const auto& error : errors) {
    EXPECT_NE(error.find("unsupported ZeRO stage 0"), std::string::npos) << error;
  }
}

TEST(ZeroOptimizerErrorsTest, GroupAddedAfterConstructionFailsTheStepOnEveryRank) {
  // torch::optim::Optimizer::add_param_group is not virtual, so the layout
  // cannot refuse it; the step, saving, loading and gathering the full
  // parameters must, before any collective (an out-of-range index or a hang
  // otherwise).
  TempDirectory dir;
  std::atomic<int> refused{0};
  auto errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    TinyModel model(0);
    ZeroOptimizer optimizer(std::vector<at::Tensor>{model.params[0], model.params[1]}, pg,
                            torch::optim::AdamWOptions(1e-3));
    optimizer.add_param_group(torch::optim::OptimizerParamGroup({model.params[2]}));
    const std::vector<std::function<void()>> entry_points = {
        [&] { optimizer.save_checkpoint(dir.path() + "/ckpt"); },
        [&] { optimizer.load_checkpoint(dir.path() + "/ckpt"); },
        [&] { optimizer.full_parameters(); },
    };
    for (const auto& entry_point : entry_points) {
      try {
        entry_point();
      } catch (const c10::Error& e) {
        const std::string message = e.what_without_backtrace();
        EXPECT_NE(message.find("2 parameter groups but was built with 1"), std::string::npos)
            << message;
        ++refused;
      }
    }
    optimizer.step();
  });
  EXPECT_EQ(refused.load(), 6);
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& error : errors) {
    EXPECT_NE(error.find("2 parameter groups but was built with 1"), std::string::npos) << error;
  }
}

// [Note: parameters that left the optimizer's storage]: a parameter given a
// copy of its values (what model.to("cpu:0") does) keeps training as
// LibTorch's optimizer would; one given other values on one rank fails the
// step on every rank, naming it.
TEST(ZeroOptimizerAttachmentTest, CopiedParametersAreFollowedAndChangedOnesRefused) {
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  const auto expected = TrainReference(adamw);
  for (int stage : {1, 2}) {
    std::vector<double> diffs(3, -1);
    std::mutex mutex;
    auto errors = RunRanks(3, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      TinyModel model(/*seed=*/rank);
      ZeroOptimizer optimizer(model.params, pg, adamw,
                              ZeroOptions().stage(stage).reduce_bucket_size(16));
      for (auto& param : model.params) {
        param.set_data(param.detach().clone());
      }
      TrainRank(rank, 3, model, optimizer, 0, kSteps);
      std::lock_guard<std::mutex> lock(mutex);
      diffs[rank] = MaxDiff(model.params, expected);
    });
    for (int rank = 0; rank < 3; ++rank) {
      EXPECT_EQ(errors[rank], "") << "stage " << stage << " rank " << rank;
      EXPECT_GE(diffs[rank], 0.0);
      EXPECT_LE(diffs[rank], 1e-6) << "stage " << stage << " rank " << rank;
    }
    errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      TinyModel model(/*seed=*/0);
      ZeroOptimizer optimizer(model.params, pg, adamw, ZeroOptions().stage(stage));
      optimizer.set_parameter_names({{"w2", model.params[2]}});
      if (rank == 1) {
        model.params[2].set_data(model.params[2].detach() + 1);
      }
      TrainRank(rank, 2, model, optimizer, 0, 1);
    });
    for (const auto& error : errors) {
      EXPECT_NE(error.find("step() refused"), std::string::npos) << error;
      EXPECT_NE(error.find("rank 1: 1 parameter(s)"), std::string::npos) << error;
      EXPECT_NE(error.find("'w2' was given other values"), std::string::npos) << error;
    }
  }
}

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
