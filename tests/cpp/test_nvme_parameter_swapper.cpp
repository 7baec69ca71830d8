// The stage-3 parameter swap space alone: writes that cut buckets read back,
// the read-ahead follows the previous iteration and never serves values older
// than the last write, max_in_cpu keeps a prefix in host memory, and the swap
// directory goes with the swapper.
#include "zeroshard/nvme_parameter_swapper.h"

#include "temp_directory.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <string>
#include <vector>

namespace zeroshard {
namespace {

// Four parameters, each its own unit and so its own bucket. The layout puts
// them in reverse registration order: at world size 2 this rank's shards of
// buckets 0-3 are 1000, 350, 2500 and 1500 elements (fp32 slots of 4, 4, 12
// and 8 KiB).
PartitionLayout four_units() {
  PartitionLayout layout({{3000, 5000, 700, 2000}}, /*world_size=*/2, /*bucket_numel=*/1 << 20,
                         {{0, 1, 2, 3}});
  std::vector<int64_t> shards;
  for (const Bucket& bucket : layout.group(0).buckets()) {
    shards.push_back(bucket.shard_numel);
  }
  EXPECT_EQ(shards, (std::vector<int64_t>{1000, 350, 2500, 1500}));
  return layout;
}

OffloadOptions nvme(const std::string& path) {
  return OffloadOptions().device(OffloadDevice::kNVMe).nvme_path(path).max_in_cpu(0);
}

bool exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

TEST(NvmeParameterSwapperTest, WritesThatCutBucketsReadBack) {
  TempDirectory dir;
  const PartitionLayout layout = four_units();
  NvmeParameterSwapper swapper(layout, {at::kFloat}, nvme(dir.path()), AioOptions(), 0);
  const int64_t shard = layout.group(0).shard_numel();
  ASSERT_EQ(shard, 1500 + 2500 + 350 + 1000);
  const at::Tensor values = at::randn({shard});
  // Pieces of 997 elements: most start or end inside a bucket.
  for (int64_t offset = 0; offset < shard; offset += 997) {
    swapper.write(0, offset, values.narrow(0, offset, std::min<int64_t>(997, shard - offset)));
  }
  // Each bucket was assembled from its pieces and written once, nothing read.
  swapper.flush();
  EXPECT_EQ(swapper.bytes_written(), (1 + 1 + 3 + 2) * 4096);
  EXPECT_EQ(swapper.bytes_read(), 0);
  for (size_t b = 0; b < 4; ++b) {
    const Bucket& bucket = layout.group(0).buckets()[b];
    EXPECT_TRUE(swapper.on_nvme(0, b));
    EXPECT_TRUE(
        at::equal(swapper.read(0, b), values.narrow(0, bucket.shard_offset, bucket.shard_numel)))
        << "bucket " << b;
  }
  // Pieces with a gap (a run the step skipped): the stored values fill it.
  const Bucket& two = layout.group(0).buckets()[2];
  const at::Tensor head = at::randn({100});
  const at::Tensor tail = at::randn({100});
  swapper.write(0, two.shard_offset, head);
  swapper.write(0, two.shard_offset + 200, tail);
  at::Tensor expected = values.narrow(0, two.shard_offset, two.shard_numel).clone();
  expected.narrow(0, 0, 100).copy_(head);
  expected.narrow(0, 200, 100).copy_(tail);
  EXPECT_TRUE(at::equal(swapper.read(0, 2), expected));
  // Slots are whole 4 KiB pages: 4000, 1400, 10000 and 6000 bytes.
  EXPECT_EQ(swapper.disk_bytes(), (1 + 1 + 3 + 2) * 4096);
  EXPECT_EQ(swapper.reads_on_demand(), 5);
}

TEST(NvmeParameterSwapperTest, ReadAheadFollowsThePlanAndNeverServesStaleValues) {
  TempDirectory dir;
  const PartitionLayout layout = four_units();
  NvmeParameterSwapper swapper(layout, {at::kFloat}, nvme(dir.path()).buffer_count(2), AioOptions(),
                               0);
  const int64_t shard = layout.group(0).shard_numel();
  swapper.write(0, 0, at::arange(shard).to(at::kFloat));
  for (size_t b = 0; b < 4; ++b) {  // the first iteration: no plan yet
    swapper.read(0, b);
  }
  EXPECT_EQ(swapper.reads_on_demand(), 4);
  EXPECT_EQ(swapper.reads_ahead(), 0);
  // The step is over: the plan's first buckets, 0 and 1 (two buffers), are
  // read at once.
  swapper.end_iteration();
  EXPECT_EQ(swapper.ahead_bytes(), 4096 + 4096);
  // Reading bucket 0 takes its buffer and starts bucket 2's read.
  swapper.read(0, 0);
  EXPECT_EQ(swapper.ahead_bytes(), 4096 + 12288);
  // Bucket 1 changes while its read-ahead is in flight or done: the read
  // must return the new values.
  const Bucket& one = layout.group(0).buckets()[1];
  const at::Tensor fresh = at::randn({one.shard_numel});
  swapper.write(0, one.shard_offset, fresh);
  EXPECT_TRUE(at::equal(swapper.read(0, 1), fresh));
  const Bucket& two = layout.group(0).buckets()[2];
  EXPECT_TRUE(
      at::equal(swapper.read(0, 2),
                at::arange(two.shard_offset, two.shard_offset + two.shard_numel).to(at::kFloat)));
  swapper.read(0, 3);
  // Buckets 0, 2 and 3 came from the read-ahead; bucket 1's was cancelled
  // (and its on-demand read started bucket 3's).
  EXPECT_EQ(swapper.reads_ahead(), 3);
  EXPECT_EQ(swapper.reads_on_demand(), 4 + 1);
  EXPECT_EQ(swapper.peak_ahead_bytes(), 12288 + 8192);

  // A read further on in the plan skips ahead to it (here past the end, so
  // nothing more is read); one the plan does not foresee stops the
  // read-ahead. What was read ahead still serves.
  swapper.end_iteration();
  swapper.read(0, 3);
  EXPECT_EQ(swapper.reads_on_demand(), 6);
  EXPECT_EQ(swapper.ahead_bytes(), 4096 + 4096);
  swapper.read(0, 0);
  EXPECT_EQ(swapper.reads_ahead(), 4);
  EXPECT_EQ(swapper.ahead_bytes(), 4096);
}

TEST(NvmeParameterSwapperTest, MaxInCpuKeepsAPrefixInHostMemory) {
  TempDirectory dir;
  const PartitionLayout layout = four_units();
  // 2850 elements: buckets 0 and 1 (1000 + 350); bucket 3 (1500) would fit
  // the rest of the budget, but the prefix ends at bucket 2 (2500), the first
  // that does not.
  NvmeParameterSwapper swapper(layout, {at::kFloat}, nvme(dir.path()).max_in_cpu(2850),
                               AioOptions(), 0);
  EXPECT_FALSE(swapper.on_nvme(0, 0));
  EXPECT_FALSE(swapper.on_nvme(0, 1));
  EXPECT_TRUE(swapper.on_nvme(0, 2));
  EXPECT_TRUE(swapper.on_nvme(0, 3));
  EXPECT_EQ(swapper.host_shard_bytes(), 1350 * 4);
  EXPECT_EQ(swapper.disk_bytes(), 12288 + 8192);
  const at::Tensor values = at::randn({layout.group(0).shard_numel()});
  swapper.write(0, 0, values);
  for (size_t b = 0; b < 4; ++b) {
    const Bucket& bucket = layout.group(0).buckets()[b];
    EXPECT_TRUE(
        at::equal(swapper.read(0, b), values.narrow(0, bucket.shard_offset, bucket.shard_numel)))
        << "bucket " << b;
  }
}

TEST(NvmeParameterSwapperTest, SwapDirectoryGoesWithTheSwapperAndBadSettingsAreErrors) {
  TempDirectory dir;
  const PartitionLayout layout = four_units();
  std::string directory;
  {
    NvmeParameterSwapper swapper(layout, {at::kBFloat16}, nvme(dir.path()), AioOptions(), 1);
    directory = swapper.directory();
    EXPECT_NE(directory.find("/zeroshard-params-rank1-"), std::string::npos) << directory;
    EXPECT_TRUE(exists(directory + "/parameters.swap"));
    // bf16: 2000, 700, 5000 and 3000 bytes: 1, 1, 2 and 1 pages.
    EXPECT_EQ(swapper.disk_bytes(), 5 * 4096);
  }
  EXPECT_FALSE(exists(directory));
  try {
    NvmeParameterSwapper swapper(layout, {at::kFloat}, nvme(dir.path()).buffer_size(2000),
                                 AioOptions(), 0);
    FAIL() << "a bucket larger than buffer_size was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("offload_param.buffer_size (2000 elements) is smaller "
                                         "than this rank's shard of bucket 2 of parameter group 0 "
                                         "(2500 elements); raise buffer_size to at least 2500"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace zeroshard
