// CPU offload from C++: the placement decision, and ZeroOptimizer with
// offload_optimizer against LibTorch's torch::optim on the global batch.
// On a CPU-only machine host and device are the same memory; the offload
// path still copies through its host buffers, so this covers its logic.
#include "zeroshard/state_placement.h"
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

#include <mutex>
#include <string>
#include <vector>

namespace zeroshard {
namespace {

OffloadOptions Cpu() { return OffloadOptions().device(OffloadDevice::kCPU); }

TEST(StatePlacement, CutsShardsIntoSubGroupsAndKeepsTheFirstOnesOnTheDeviceByRatio) {
  // Two groups: 25 elements -> 10, 10, 5; 7 -> 7. Four sub-groups in all.
  StatePlacement placement({25, 7}, 10, Cpu().ratio(0.5), OffloadOptions(), c10::kCPU);
  ASSERT_EQ(placement.sub_groups(0).size(), 3u);
  EXPECT_EQ(placement.sub_groups(0)[2].offset, 20);
  EXPECT_EQ(placement.sub_groups(0)[2].numel, 5);
  // floor((1 - 0.5) * 4) = 2 stay on the device.
  EXPECT_EQ(placement.sub_groups(0)[0].tier, StateTier::kDevice);
  EXPECT_EQ(placement.sub_groups(0)[1].tier, StateTier::kDevice);
  EXPECT_EQ(placement.sub_groups(0)[2].tier, StateTier::kHost);
  EXPECT_EQ(placement.sub_groups(1)[0].tier, StateTier::kHost);
  EXPECT_EQ(placement.host_sub_group_count(), 2);
  EXPECT_EQ(placement.largest_host_sub_group(), 7);
  // Pinned memory only helps asynchronous copies to an accelerator.
  EXPECT_FALSE(placement.pinned(StateTier::kHost, false));
  EXPECT_EQ(placement.parameter_tier(), StateTier::kDevice);
  // Group 0 updates partly on the device, so its gradient shard stays there
  // and its host sub-group is fed through staging; group 1 is all on the
  // host, so its shard lives there (in fp32) and the kernel reads it in place.
  EXPECT_FALSE(placement.gradient_shard_on_host(0));
  EXPECT_TRUE(placement.gradient_shard_on_host(1));
  EXPECT_TRUE(placement.stages_gradients());
  EXPECT_FALSE(placement.reads_gradient_in_place(0));
  EXPECT_TRUE(placement.reads_gradient_in_place(1));
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  EXPECT_EQ(placement.gradient_shard_options(0, bf16).dtype(), at::kBFloat16);
  EXPECT_EQ(placement.gradient_shard_options(1, bf16).dtype(), at::kFloat);
  StatePlacement all({25, 7}, 10, Cpu(), OffloadOptions(), c10::kCPU);
  EXPECT_TRUE(all.gradient_shard_on_host(0));
  EXPECT_TRUE(all.gradient_shard_on_host(1));
  EXPECT_FALSE(all.stages_gradients());
  // NVMe: the shard is on the host too, but as reduced (RAM is what binds),
  // and the step widens it through staging.
  StatePlacement nvme({25, 7}, 10, OffloadOptions().device(OffloadDevice::kNVMe).nvme_path("/x"),
                      OffloadOptions(), c10::kCPU);
  EXPECT_TRUE(nvme.gradient_shard_on_host(0));
  EXPECT_FALSE(nvme.reads_gradient_in_place(0));
  EXPECT_TRUE(nvme.stages_gradients());
  EXPECT_EQ(nvme.gradient_shard_options(0, bf16).dtype(), at::kBFloat16);

  StatePlacement none({25}, 10, OffloadOptions(), OffloadOptions(), c10::kCPU);
  for (const auto& sub_group : none.sub_groups(0)) {
    EXPECT_EQ(sub_group.tier, StateTier::kDevice);
  }
  EXPECT_FALSE(none.gradient_shard_on_host(0));
  EXPECT_FALSE(none.stages_gradients());
  EXPECT_THROW(StatePlacement({25}, 0, Cpu(), OffloadOptions(), c10::kCPU), c10::Error);
}

#ifdef ZEROSHARD_WITH_GLOO

constexpr int kSteps = 10;

std::vector<at::Tensor> TrainReference(const torch::optim::OptimizerOptions& options,
                                       double max_norm) {
  TinyModel model(0);
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

struct Case {
  int64_t stage;
  int64_t sub_group_size;
  double ratio;
  double max_norm;
  OffloadDevice device = OffloadDevice::kCPU;
};

class OffloadTest : public ::testing::TestWithParam<int> {};

TEST_P(OffloadTest, MatchesLibTorchAtEveryStageSubGroupSizeAndRatio) {
  const int world = GetParam();
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  for (const torch::optim::OptimizerOptions* options :
       std::initializer_list<const torch::optim::OptimizerOptions*>{&adamw, &sgd}) {
    for (const Case& c :
         {Case{1, 1000000000, 1.0, 0}, Case{2, 9, 1.0, 0.3}, Case{2, 9, 0.5, 0},
          Case{3, 9, 1.0, 0.3}, Case{1, 7, 1.0, 0, OffloadDevice::kNVMe},
          Case{2, 9, 0.5, 0.3, OffloadDevice::kNVMe}, Case{3, 9, 1.0, 0.3, OffloadDevice::kNVMe}}) {
      TempDirectory swap;
      const OffloadOptions offload =
          OffloadOptions().device(c.device).ratio(c.ratio).nvme_path(swap.path());
      const auto expected = TrainReference(*options, c.max_norm);
      std::vector<double> diffs(world, -1);
      std::vector<int64_t> host_bytes(world, -1);
      std::mutex mutex;
      auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
        TinyModel model(rank);
        std::vector<ParameterUnit> units;
        if (c.stage == 3) {
          units.push_back(ParameterUnit{"layer1", {model.params[0], model.params[1]}});
          units.push_back(ParameterUnit{"layer2", {model.params[2], model.params[3]}});
        }
        ZeroOptimizer optimizer(model.params, pg, *options,
                                ZeroOptions()
                                    .stage(c.stage)
                                    .reduce_bucket_size(16)
                                    .max_norm(c.max_norm)
                                    .stage3_param_persistence_threshold(0)
                                    .sub_group_size(c.sub_group_size)
                                    .offload_optimizer(offload),
                                units);
        const int64_t per_rank = kGlobalBatch / world;
        for (int step = 0; step < kSteps; ++step) {
          auto [x, target] = GlobalBatch(step);
          optimizer.zero_grad();
          for (int64_t u = 0; u < optimizer.num_units(); ++u) {
            optimizer.unit_pre_forward(u);  // no module hooks here: units by hand
          }
          model
              .loss(x.narrow(0, rank * per_rank, per_rank),
                    target.narrow(0, rank * per_rank, per_rank))
              .backward();
          for (int64_t u = optimizer.num_units() - 1; u >= 0; --u) {
            optimizer.unit_post_forward(u);  // held through backward, released now
          }
          optimizer.step();
        }
        std::vector<at::Tensor> full;
        for (auto& group : optimizer.full_parameters(0)) {
          full.insert(full.end(), group.begin(), group.end());
        }
        std::lock_guard<std::mutex> lock(mutex);
        host_bytes[rank] = optimizer.host_model_state_bytes();
        diffs[rank] = rank == 0 ? MaxDiff(full, expected) : 0.0;
      });
      for (int rank = 0; rank < world; ++rank) {
        EXPECT_EQ(errors[rank], "") << "rank " << rank;
        EXPECT_GE(diffs[rank], 0.0);
        EXPECT_LE(diffs[rank], 1e-6)
            << "stage " << c.stage << " sub-group " << c.sub_group_size << " ratio " << c.ratio
            << " world " << world << " " << offload_device_name(c.device);
        EXPECT_GT(host_bytes[rank], 0) << "state was offloaded";
      }
      EXPECT_TRUE(swap.empty()) << "the swap space outlived the optimizer";
    }
  }
}

TEST_P(OffloadTest, BadOffloadSettingsFailOnEveryRankNamingTheSetting) {
  const int world = GetParam();
  auto adamw = torch::optim::AdamWOptions(1e-2);
  const std::vector<std::pair<ZeroOptions, std::string>> cases = {
      {ZeroOptions().stage(2).offload_param(Cpu()), "offload_param moves parameter shards"},
      {ZeroOptions().offload_optimizer(Cpu().ratio(1.5)), "offload_optimizer.ratio must be in"},
      {ZeroOptions().sub_group_size(0), "sub_group_size must be > 0"},
      {ZeroOptions().offload_optimizer(OffloadOptions().device(OffloadDevice::kNVMe)),
       "offload_optimizer.device = 'nvme' needs nvme_path"},
      {ZeroOptions().offload_optimizer(
           OffloadOptions().device(OffloadDevice::kNVMe).nvme_path("/nonexistent/zeroshard")),
       "nvme_path '/nonexistent/zeroshard' is not an existing directory"},
      {ZeroOptions().stage(3).offload_param(
           OffloadOptions().device(OffloadDevice::kNVMe).nvme_path("/tmp")),
       "offload_param.device = 'nvme' needs offload_optimizer.device = 'cpu' or 'nvme'"},
      {ZeroOptions().stage(3).offload_optimizer(Cpu()).offload_param(
           OffloadOptions().device(OffloadDevice::kNVMe)),
       "offload_param.device = 'nvme' needs nvme_path"},
      {ZeroOptions().stage(3).offload_optimizer(Cpu()).offload_param(
           OffloadOptions().device(OffloadDevice::kNVMe).nvme_path("/nonexistent/zeroshard")),
       "could not set up the NVMe swap space for parameters"},
  };
  for (const auto& [options, message] : cases) {
    auto errors = RunRanks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      TinyModel model(0);
      ZeroOptimizer optimizer(model.params, pg, adamw, options);
    });
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_NE(errors[rank].find(message), std::string::npos)
          << "rank " << rank << ": " << errors[rank];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, OffloadTest, ::testing::Values(2, 3));

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
