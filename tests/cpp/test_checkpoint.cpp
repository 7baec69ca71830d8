// Checkpoints from C++: the CRC-32C and safetensors building blocks, and a
// ZeroOptimizer checkpoint saved at one world size and stage and loaded at
// another, bit for bit.
#include "zeroshard/crc32c.h"
#include "zeroshard/safetensors.h"
#include "zeroshard/zero_optimizer.h"

#ifdef ZEROSHARD_WITH_GLOO
#include "rank_threads.h"
#endif

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

namespace zeroshard {
namespace {

std::string TempDir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("zeroshard_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(Crc32c, MatchesTheStandardCheckValueInPiecesAndWhole) {
  const std::string text = "123456789";
  EXPECT_EQ(crc32c(text.data(), text.size()), 0xE3069283u);  // RFC 3720's check value
  EXPECT_EQ(crc32c(text.data() + 4, 5, crc32c(text.data(), 4)), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(Safetensors, WritesWhatTheReaderReadsBackWithOffsetsAndChecksums) {
  const std::string path = TempDir("safetensors") + "/t.safetensors";
  at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3});
  at::Tensor b = at::arange(5, at::kLong);
  WrittenPiece piece_a, piece_b;
  {
    SafetensorsWriter writer(path, {{"a", at::kFloat, {2, 3}}, {"b", at::kLong, {5}}},
                             {{"format", "pt"}});
    piece_a = writer.append(a);
    piece_b = writer.append(b);
    writer.finish();
  }
  SafetensorsReader reader(path);
  EXPECT_TRUE(at::equal(reader.tensor("a"), a));
  EXPECT_TRUE(at::equal(reader.tensor("b"), b));
  EXPECT_EQ(reader.header().at("__metadata__").at("format"), "pt");
  EXPECT_EQ(piece_a.offset, reader.data_start());
  EXPECT_EQ(piece_b.offset, reader.data_start() + 24);
  EXPECT_EQ(piece_b.crc32c, crc32c(b.data_ptr(), 40));
  EXPECT_EQ(reader.data_start() % 8, 0);  // the header is padded, as safetensors does
  EXPECT_THROW(SafetensorsWriter(path, {{"x", at::kFloat, {1}}, {"x", at::kFloat, {1}}}),
               c10::Error);
}

#ifdef ZEROSHARD_WITH_GLOO

constexpr int64_t kBatch = 12;

// w1 [7,5], b1 [7], w2 [3,7], scale [1]: uneven sizes, one smaller than any world.
std::vector<at::Tensor> MakeParams(uint64_t seed) {
  auto generator = at::detail::createCPUGenerator(seed);
  std::vector<at::Tensor> params;
  for (auto sizes : std::vector<std::vector<int64_t>>{{7, 5}, {7}, {3, 7}, {1}}) {
    params.push_back((at::randn(sizes, generator) * 0.5).set_requires_grad(true));
  }
  return params;
}

std::vector<std::pair<std::string, at::Tensor>> Named(const std::vector<at::Tensor>& params) {
  return {{"w1", params[0]}, {"b1", params[1]}, {"w2", params[2]}, {"scale", params[3]}};
}

void Train(ZeroOptimizer& optimizer, const std::vector<at::Tensor>& params, int rank, int world,
           int first, int steps) {
  for (int step = first; step < first + steps; ++step) {
    auto generator = at::detail::createCPUGenerator(500 + step);
    at::Tensor x = at::randn({kBatch, 5}, generator);
    at::Tensor y = at::randn({kBatch, 3}, generator);
    const int64_t per_rank = kBatch / world;
    x = x.narrow(0, rank * per_rank, per_rank);
    y = y.narrow(0, rank * per_rank, per_rank);
    optimizer.zero_grad();
    at::Tensor h = (x.matmul(params[0].t()) + params[1]).tanh();
    ((h.matmul(params[2].t()) * params[3]) - y).pow(2).mean().backward();
    optimizer.step();
  }
}

std::vector<at::Tensor> Flatten(std::vector<std::vector<at::Tensor>> groups) {
  std::vector<at::Tensor> out;
  for (auto& group : groups) {
    out.insert(out.end(), group.begin(), group.end());
  }
  return out;
}

TEST(Checkpoint, SavedAtWorldTwoStageTwoLoadsAtWorldThreeStageOneBitForBit) {
  const std::string dir = TempDir("reshard") + "/ckpt";
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  std::vector<at::Tensor> saved, loaded;
  std::mutex mutex;
  auto errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto params = MakeParams(0);
    ZeroOptimizer optimizer(params, pg, adamw, ZeroOptions().stage(2).reduce_bucket_size(16));
    optimizer.set_parameter_names(Named(params));
    Train(optimizer, params, rank, 2, 0, 3);
    optimizer.save_checkpoint(dir);
    auto full = Flatten(optimizer.full_parameters(0));
    std::lock_guard<std::mutex> lock(mutex);
    if (rank == 0) {
      saved = full;
    }
  });
  for (const auto& error : errors) {
    ASSERT_EQ(error, "");
  }
  ASSERT_TRUE(std::filesystem::exists(dir + "/index.json"));
  ASSERT_FALSE(std::filesystem::exists(dir + ".tmp"));
  errors = RunRanks(3, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto params = MakeParams(7);  // other values: the load must replace them
    ZeroOptimizer optimizer(params, pg, adamw, ZeroOptions().stage(1));
    optimizer.set_parameter_names(Named(params));
    optimizer.load_checkpoint(dir);
    std::vector<at::Tensor> model;
    for (const auto& p : params) {
      model.push_back(p.detach().clone());
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (rank == 0) {
      loaded = model;
    }
  });
  for (const auto& error : errors) {
    ASSERT_EQ(error, "");
  }
  ASSERT_EQ(loaded.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_TRUE(at::equal(loaded[i], saved[i])) << "parameter " << i;
  }
}

TEST(Checkpoint, AnotherModelIsAnErrorOnEveryRankNamingTheParameter) {
  const std::string dir = TempDir("foreign") + "/ckpt";
  auto adamw = torch::optim::AdamWOptions(1e-2);
  auto errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto params = MakeParams(0);
    ZeroOptimizer optimizer(params, pg, adamw, ZeroOptions().stage(1));
    optimizer.set_parameter_names(Named(params));
    optimizer.save_checkpoint(dir);
  });
  for (const auto& error : errors) {
    ASSERT_EQ(error, "");
  }
  errors = RunRanks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto params = MakeParams(0);
    params[2] = at::randn({4, 7}).set_requires_grad(true);  // w2 has another shape
    ZeroOptimizer optimizer(params, pg, adamw, ZeroOptions().stage(2));
    optimizer.set_parameter_names(Named(params));
    optimizer.load_checkpoint(dir);
  });
  for (const auto& error : errors) {
    EXPECT_NE(error.find("is of another model"), std::string::npos) << error;
    EXPECT_NE(error.find("'w2' has shape [4, 7] here but [3, 7] saved"), std::string::npos)
        << error;
  }
}

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
