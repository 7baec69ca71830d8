// The NVMe gradient swap space alone (offload_optimizer.swap_gradients), on
// both I/O back ends: slices that cut blocks, arriving in any order, sum as a
// resident shard would; a second round adds to the first; clear() zeroes with
// no I/O; the step's aligned reads give the values at their lead; at most
// the blocks a round holds open plus buffer_count writes are in memory; a
// damaged file is an error naming it; the directory goes with the swapper.
#include "zeroshard/nvme_gradient_swapper.h"

#include "temp_directory.h"
#include "zeroshard/mapped_host_memory.h"

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/randperm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {
namespace {

constexpr int64_t kBlock = 2048;  // small blocks, so every group has several
const std::vector<int64_t> kNumels = {5000, 0, 3001};

// Cuts [0, numel) into slices of 1..700 elements (as buckets cut a shard)
// and shuffles them: backward delivers buckets in no fixed relation to the
// blocks.
std::vector<std::pair<int64_t, int64_t>> shuffled_slices(int64_t numel, uint64_t seed) {
  std::vector<std::pair<int64_t, int64_t>> slices;
  uint64_t state = seed;
  for (int64_t offset = 0; offset < numel;) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const int64_t length = std::min<int64_t>(numel - offset, 1 + (state >> 33) % 700);
    slices.emplace_back(offset, length);
    offset += length;
  }
  const at::Tensor order = at::randperm(static_cast<int64_t>(slices.size()), at::kLong);
  std::vector<std::pair<int64_t, int64_t>> shuffled;
  for (int64_t i = 0; i < order.numel(); ++i) {
    shuffled.push_back(slices[order[i].item<int64_t>()]);
  }
  return shuffled;
}

void deliver_round(NvmeGradientSwapper& swapper, const std::vector<at::Tensor>& values,
                   uint64_t seed) {
  for (size_t g = 0; g < kNumels.size(); ++g) {
    for (const auto& [offset, length] : shuffled_slices(kNumels[g], seed + g)) {
      swapper.accumulate(g, offset, values[g].narrow(0, offset, length));
    }
  }
  swapper.flush();
}

// Parameter: true runs on io_uring, false on the thread pool. The io_uring
// cases skip (GTEST_SKIP, reported as skipped) only where the kernel or a
// seccomp profile refuses io_uring: the swapper would run on the thread pool
// there, which the false cases test. On this project's machine it is
// available and they run.
class NvmeGradientSwapperTest : public ::testing::TestWithParam<bool> {
 protected:
  OffloadOptions offload() const {
    return OffloadOptions().device(OffloadDevice::kNVMe).nvme_path(dir_.path()).buffer_count(2);
  }
  AioOptions aio() const { return AioOptions().use_io_uring(GetParam()).queue_depth(4); }
  TempDirectory dir_;
};

TEST_P(NvmeGradientSwapperTest, RoundsOfShuffledSlicesSumAsAResidentShard) {
  if (GetParam() && !io_uring_available()) {
    GTEST_SKIP() << "io_uring is not available here";
  }
  NvmeGradientSwapper swapper(offload(), aio(), 0, kNumels, kBlock);
  EXPECT_FALSE(swapper.swaps(1));
  // Each group's region rounded up to 4 KiB: 20,000 -> 20,480 and 12,004 -> 12,288.
  EXPECT_EQ(swapper.disk_bytes(), 20480 + 12288);
  std::vector<at::Tensor> first{at::randn({5000}), at::Tensor(), at::randn({3001})};
  std::vector<at::Tensor> second{at::randn({5000}).to(at::kBFloat16), at::Tensor(),
                                 at::randn({3001}).to(at::kBFloat16)};
  deliver_round(swapper, first, 1);
  // One aligned write per block, nothing read.
  EXPECT_EQ(swapper.bytes_written(), swapper.disk_bytes());
  EXPECT_EQ(swapper.bytes_read(), 0);
  for (size_t g : {size_t{0}, size_t{2}}) {
    EXPECT_TRUE(at::equal(swapper.read(g, 0, kNumels[g]), first[g])) << g;
  }
  // A second round (gradient accumulation, 16-bit slices) adds in fp32.
  deliver_round(swapper, second, 7);
  for (size_t g : {size_t{0}, size_t{2}}) {
    const at::Tensor expected = first[g].add(second[g].to(at::kFloat));
    EXPECT_TRUE(at::equal(swapper.read(g, 0, kNumels[g]), expected)) << g;
    // The step's reads: any offset, values at the lead of an aligned buffer.
    for (const auto& [offset, length] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1023, 2}, {2047, 1000}, {4000, 1000}}) {
      if (offset + length > kNumels[g]) {
        continue;
      }
      const at::Tensor buffer = at::zeros({NvmeGradientSwapper::read_capacity(length) + 1024});
      // at::zeros is 64-byte aligned; step to the next page for the direct path.
      auto* base = buffer.data_ptr<float>();
      auto* page = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(base) + 4095) & ~4095ULL);
      swapper.wait_read(swapper.submit_read(g, offset, length, page));
      const at::Tensor got =
          buffer.narrow(0, page - base + NvmeGradientSwapper::read_lead(offset), length);
      EXPECT_TRUE(at::equal(got, expected.narrow(0, offset, length))) << g << " " << offset;
    }
  }
  EXPECT_LE(swapper.buffer_bytes(), 2 * kBlock * 4) << "the pool keeps buffer_count blocks";
  // clear() forgets without I/O; the next round starts from zeros.
  const int64_t moved = swapper.bytes_read() + swapper.bytes_written();
  swapper.clear();
  EXPECT_EQ(swapper.bytes_read() + swapper.bytes_written(), moved);
  EXPECT_TRUE(at::equal(swapper.read(0, 0, 5000), at::zeros({5000})));
  deliver_round(swapper, first, 3);
  EXPECT_TRUE(at::equal(swapper.read(2, 0, 3001), first[2]));
  // write() replaces a range (the replica reduction's write-back).
  const at::Tensor patch = at::randn({1500});
  swapper.write(0, 1800, patch);
  at::Tensor expected = first[0].clone();
  expected.narrow(0, 1800, 1500).copy_(patch);
  EXPECT_TRUE(at::equal(swapper.read(0, 0, 5000), expected));
}

TEST_P(NvmeGradientSwapperTest, SlicesInBackwardOrderHoldAFewBlocksNotTheShard) {
  if (GetParam() && !io_uring_available()) {
    GTEST_SKIP() << "io_uring is not available here";
  }
  // Ten blocks; slices of 700 elements arriving from the end of the shard to
  // its start, as backward delivers the buckets of a layer stack.
  const int64_t numel = 10 * kBlock;
  NvmeGradientSwapper swapper(offload(), aio(), 0, {numel}, kBlock);
  const at::Tensor values = at::randn({numel});
  for (int64_t end = numel; end > 0; end -= 700) {
    const int64_t begin = std::max<int64_t>(0, end - 700);
    swapper.accumulate(0, begin, values.narrow(0, begin, end - begin));
  }
  swapper.flush();
  EXPECT_TRUE(at::equal(swapper.read(0, 0, numel), values));
  // At most: the block being filled and the one a slice cut, plus
  // buffer_count (2) writes draining; not the ten blocks of the shard.
  EXPECT_LE(swapper.peak_buffer_bytes(), 4 * kBlock * 4);
}

TEST_P(NvmeGradientSwapperTest, ADamagedFileIsAnErrorNamingItAndTheDirectoryGoesWithTheSwapper) {
  if (GetParam() && !io_uring_available()) {
    GTEST_SKIP() << "io_uring is not available here";
  }
  std::string directory;
  {
    NvmeGradientSwapper swapper(offload(), aio(), 3, kNumels, kBlock);
    directory = swapper.directory();
    EXPECT_NE(directory.find("zeroshard-grads-rank3-"), std::string::npos) << directory;
    deliver_round(swapper, {at::randn({5000}), at::Tensor(), at::randn({3001})}, 5);
    ASSERT_EQ(::truncate((directory + "/gradients.swap").c_str(), 4096), 0);
    // Outside the step a failure is kept, not thrown (the optimizer raises it
    // on every rank): the read gives zeros and failure() names the file.
    EXPECT_TRUE(at::equal(swapper.read(2, 0, 3001), at::zeros({3001})));
    const std::string kept = swapper.failure();
    EXPECT_NE(kept.find("gradients.swap"), std::string::npos) << kept;
    EXPECT_NE(kept.find("read"), std::string::npos) << kept;
    // Later I/O is skipped; the step's reads raise it.
    swapper.accumulate(0, 0, at::ones({10}));
    EXPECT_EQ(swapper.failure(), kept);
    const at::Tensor buffer = mapped_host_empty(NvmeGradientSwapper::read_capacity(10), at::kFloat);
    try {
      swapper.submit_read(0, 0, 10, buffer.data_ptr<float>());
      ADD_FAILURE() << "the step's read did not raise the kept failure";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("is incomplete"), std::string::npos) << message;
      EXPECT_NE(message.find("gradients.swap"), std::string::npos) << message;
    }
    // zero_grad forgets the failure with the contents.
    swapper.clear();
    EXPECT_TRUE(swapper.failure().empty());
  }
  struct stat info {};
  EXPECT_NE(::stat(directory.c_str(), &info), 0) << "the swap directory outlived the swapper";
}

INSTANTIATE_TEST_SUITE_P(Backends, NvmeGradientSwapperTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("IoUring") : std::string("ThreadPool");
                         });

}  // namespace
}  // namespace zeroshard
