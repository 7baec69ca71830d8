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
#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <unistd.h>

#include <cmath>
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

// Tensor parallelism from C++: pieces of unsplit tensors a and b, split
// unevenly (a [7, 5] by columns, b [5, 3] by rows), and c [4] a copy on both
// tensor-parallel ranks. `cut` is where the split falls: a's first column on
// TP rank 1, b's first row there.
struct SplitModel {
  std::vector<at::Tensor> params;  // this rank's a, b, c
  std::vector<std::vector<TensorParallelSplit>> splits;
};

const std::vector<std::vector<int64_t>> kUnsplitShapes = {{7, 5}, {5, 3}, {4}};

// The unsplit gradient of parameter i at `step`: k/8 for small integers k, so a
// sum over ranks divided by their number is exact.
at::Tensor UnsplitGradient(size_t i, int step) {
  int64_t numel = 1;
  for (int64_t extent : kUnsplitShapes[i]) {
    numel *= extent;
  }
  return ((at::arange(numel, at::kFloat) * (3 + step) + static_cast<double>(i)).fmod(11) - 5)
      .div(8)
      .reshape(kUnsplitShapes[i]);
}

at::Tensor Piece(const at::Tensor& unsplit, const TensorParallelSplit& split, int64_t length) {
  return split.dim < 0 ? unsplit.clone()
                       : unsplit.narrow(split.dim, split.start, length).contiguous();
}

SplitModel MakeSplitModel(int tp_rank, int tp_size, const std::vector<int64_t>& cut) {
  SplitModel model;
  model.splits.resize(1);
  const std::vector<int64_t> dims = {1, 0, -1};
  for (size_t i = 0; i < 3; ++i) {
    TensorParallelSplit split{dims[i], 0, kUnsplitShapes[i]};
    int64_t length = 0;
    if (tp_size > 1 && split.dim >= 0) {
      split.start = tp_rank == 0 ? 0 : cut[i];
      length = tp_rank == 0 ? cut[i] : kUnsplitShapes[i][split.dim] - cut[i];
    } else {
      split.dim = -1;
    }
    int64_t numel = 1;
    for (int64_t extent : kUnsplitShapes[i]) {
      numel *= extent;
    }
    at::Tensor unsplit = (at::arange(numel, at::kFloat) * 0.01 - 0.1).reshape(kUnsplitShapes[i]);
    model.params.push_back(Piece(unsplit, split, length).set_requires_grad(true));
    model.splits[0].push_back(split);
  }
  return model;
}

// One step of synthetic gradients (every rank the same, so averaging keeps
// them exact).
void StepSplitModel(ZeroOptimizer& optimizer, SplitModel& model, int step) {
  for (size_t i = 0; i < 3; ++i) {
    const TensorParallelSplit& split = model.splits[0][i];
    model.params[i].mutable_grad() =
        Piece(UnsplitGradient(i, step), split, split.dim < 0 ? 0 : model.params[i].size(split.dim));
  }
  optimizer.step();
}

// The unsplit tensors, put together from every tensor-parallel rank's pieces.
void Assemble(std::vector<at::Tensor>& unsplit, const SplitModel& model) {
  for (size_t i = 0; i < 3; ++i) {
    const TensorParallelSplit& split = model.splits[0][i];
    if (!unsplit[i].defined()) {
      unsplit[i] = at::full(kUnsplitShapes[i], std::nan(""), at::kFloat);
    }
    const at::Tensor values = model.params[i].detach();
    if (split.dim < 0) {
      unsplit[i].copy_(values);
    } else {
      unsplit[i].narrow(split.dim, split.start, values.size(split.dim)).copy_(values);
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> SplitNames(const SplitModel& model) {
  return {{"a", model.params[0]}, {"b", model.params[1]}, {"c", model.params[2]}};
}

// DP 2 x TP 2 on 4 threads: the shard groups {0,1}, {2,3} of RunHybridRanks
// serve as data-parallel groups, its "replicate" groups {0,2}, {1,3} as
// tensor-parallel ones. Returns the unsplit values after `steps` more steps.
std::vector<at::Tensor> RunSplit(const std::string& load, const std::string& save,
                                 const std::vector<int64_t>& cut, int first, int steps) {
  std::vector<at::Tensor> unsplit(3);
  std::mutex mutex;
  auto errors = RunHybridRanks(4, 2, [&](int rank, HybridGroups groups) {
    const int tp_rank = rank / 2;
    SplitModel model = MakeSplitModel(tp_rank, 2, cut);
    ZeroOptimizer optimizer(model.params, groups.shard, torch::optim::AdamWOptions(1e-2),
                            ZeroOptions().stage(1));
    optimizer.set_tensor_parallel(groups.replicate, {{true, true, false}}, model.splits);
    optimizer.set_parameter_names(SplitNames(model));
    if (!load.empty()) {
      optimizer.load_checkpoint(load);
    }
    for (int step = first; step < first + steps; ++step) {
      StepSplitModel(optimizer, model, step);
    }
    if (!save.empty()) {
      optimizer.save_checkpoint(save);
    }
    std::lock_guard<std::mutex> lock(mutex);
    Assemble(unsplit, model);
  });
  for (const auto& error : errors) {
    EXPECT_EQ(error, "");
  }
  return unsplit;
}

TEST(Checkpoint, TensorParallelPiecesLoadAtAnotherSplitAndWithoutTensorParallelism) {
  const std::string dir = TempDir("tensor_parallel") + "/ckpt";
  RunSplit("", dir, {3, 3}, 0, 2);
  // Resumed with the splits falling elsewhere (1 | 4 columns of a, 4 | 1
  // rows of b), and on 3 ranks without TP (world 3 divides none of the
  // sizes): one more step each, which reads every moment and step count.
  const std::vector<at::Tensor> moved = RunSplit(dir, "", {1, 4}, 2, 1);
  std::vector<at::Tensor> plain;
  std::mutex mutex;
  auto errors = RunRanks(3, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    SplitModel model = MakeSplitModel(0, 1, {});
    ZeroOptimizer optimizer(model.params, pg, torch::optim::AdamWOptions(1e-2),
                            ZeroOptions().stage(2).reduce_bucket_size(8));
    optimizer.set_parameter_names(SplitNames(model));
    optimizer.load_checkpoint(dir);
    StepSplitModel(optimizer, model, 2);
    std::lock_guard<std::mutex> lock(mutex);
    if (rank == 0) {
      for (const auto& p : model.params) {
        plain.push_back(p.detach().clone());
      }
    }
  });
  for (const auto& error : errors) {
    ASSERT_EQ(error, "");
  }
  const std::vector<at::Tensor> uninterrupted = RunSplit("", "", {3, 3}, 0, 3);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::equal(moved[i], uninterrupted[i])) << "parameter " << i;
    EXPECT_TRUE(at::equal(plain[i], uninterrupted[i])) << "parameter " << i;
  }
}

// Names that do not stand for one tensor across the writing ranks: every
// rank raises, and no checkpoint appears.
TEST(Checkpoint, ANameForTwoTensorsOrForHalfATensorIsAnErrorOnEveryRank) {
  for (const bool rename : {false, true}) {
    // A directory per case: the failed save leaves its staging directory,
    // and removing it (std::filesystem::remove_all) crashes in this binary.
    const std::string dir = TempDir(rename ? "unknown_name" : "ambiguous") + "/ckpt";
    auto errors = RunHybridRanks(4, 2, [&](int rank, HybridGroups groups) {
      const int tp_rank = rank / 2;
      SplitModel model = MakeSplitModel(tp_rank, 2, {3, 3});
      ZeroOptimizer optimizer(model.params, groups.shard, torch::optim::AdamWOptions(1e-2),
                              ZeroOptions().stage(1));
      // c as a tensor of each rank's own (an expert): both TP ranks write it.
      optimizer.set_tensor_parallel(groups.replicate, {{true, true, !rename}}, model.splits);
      auto names = SplitNames(model);
      if (rename && tp_rank == 1) {
        names[0].first = "a_on_tp_rank_1";
      }
      optimizer.set_parameter_names(names);
      optimizer.save_checkpoint(dir);
    });
    const std::string expected =
        // Renamed on TP rank 1, a holds only rank 0's 3 columns of 7 rows.
        rename ? "stored 21 elements of exp_avg for parameter 'a' of 35" : "for parameter 'c' of 4";
    for (const auto& error : errors) {
      EXPECT_NE(error.find(expected), std::string::npos) << error;
    }
    EXPECT_FALSE(std::filesystem::exists(dir + "/index.json"));
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
