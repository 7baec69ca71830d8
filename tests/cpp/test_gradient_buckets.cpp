// GradientBuckets: [Note: the first round writes the shard]. With the flag
// set, the first round after reset() reduce-scatters into the shard whatever
// it held (NaN here), so its owner need not zero it; a second round adds to
// that sum; reset() makes the next round write again. Without the flag the
// round adds into what the shard held. 3 ranks, uneven parameters, buckets
// with padding; both of Gloo's reduce-scatters (zeroshard's all-to-all and
// c10d's emulation), each writing into a view of the shard.
#include "zeroshard/gradient_buckets.h"

#ifdef ZEROSHARD_WITH_GLOO
#include "rank_threads.h"
#endif

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace zeroshard {
namespace {

#ifdef ZEROSHARD_WITH_GLOO

constexpr int kWorld = 3;
const std::vector<int64_t> kNumels = {7, 13, 5, 22};

// Parameter i's gradient on `rank`: halves and small integers, so every sum
// is exact whatever the order.
at::Tensor GradientOf(size_t i, int rank) {
  return at::arange(kNumels[i], at::kFloat) * 0.5 + 10.0 * static_cast<double>(i) + rank;
}

// This rank's shard of the sum over ranks, padding zero.
at::Tensor ExpectedShard(const GroupLayout& group, int rank) {
  at::Tensor flat = at::zeros({group.flat_numel()});
  for (size_t i = 0; i < kNumels.size(); ++i) {
    const ParamSlot& slot = group.slot_of_param(static_cast<int64_t>(i));
    for (int r = 0; r < kWorld; ++r) {
      flat.narrow(0, slot.flat_offset, slot.numel).add_(GradientOf(i, r));
    }
  }
  at::Tensor shard = at::empty({group.shard_numel()});
  for (const Bucket& bucket : group.buckets()) {
    shard.narrow(0, bucket.shard_offset, bucket.shard_numel)
        .copy_(flat.narrow(0, group.rank_slice_offset(bucket, rank), bucket.shard_numel));
  }
  return shard;
}

struct Rounds {
  at::Tensor first;        // after the first round, over a shard of NaN
  at::Tensor second;       // after a second round without reset()
  at::Tensor after_reset;  // after reset() and a round, over NaN again
  at::Tensor expected;
  std::string error;
};

Rounds RunRounds(int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool writes,
                 bool all_to_all) {
  const PartitionLayout layout({kNumels}, kWorld, /*bucket_numel=*/16);
  const GroupLayout& group = layout.group(0);
  Communicator comm(pg);
  comm.set_reduce_scatter_all_to_all(all_to_all);
  at::Tensor shard;
  GradientBuckets buckets(
      layout, comm, {at::TensorOptions().dtype(at::kFloat)},
      [&](size_t) -> at::Tensor& { return shard; }, /*max_in_flight=*/2);
  buckets.set_first_round_writes_shard({writes});
  const auto round = [&] {
    // Reverse registration order, as backward delivers them.
    for (size_t i = kNumels.size(); i-- > 0;) {
      buckets.add_gradient(0, static_cast<int64_t>(i), GradientOf(i, rank));
    }
    buckets.flush(nullptr, /*force_round=*/true);
    buckets.wait_all();
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Rounds result;
  shard = at::full({group.shard_numel()}, nan);
  round();
  result.first = shard.clone();
  round();
  result.second = shard.clone();
  buckets.reset();
  shard = at::full({group.shard_numel()}, nan);
  round();
  result.after_reset = shard.clone();
  result.expected = ExpectedShard(group, rank);
  return result;
}

// RunRounds on every rank; error: that rank's failure, "" when it succeeded.
std::vector<Rounds> RunOnEveryRank(bool writes, bool all_to_all) {
  std::vector<Rounds> results(kWorld);
  const auto errors = RunRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    results[rank] = RunRounds(rank, pg, writes, all_to_all);
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    results[rank].error = errors[rank];
  }
  return results;
}

class GradientBucketsTest : public ::testing::TestWithParam<bool> {};

TEST_P(GradientBucketsTest, TheFirstRoundAfterResetWritesTheShardLaterRoundsAdd) {
  const auto results = RunOnEveryRank(/*writes=*/true, /*all_to_all=*/GetParam());
  for (int rank = 0; rank < kWorld; ++rank) {
    const Rounds& r = results[rank];
    ASSERT_EQ(r.error, "") << "rank " << rank;
    EXPECT_TRUE(at::equal(r.first, r.expected)) << "rank " << rank << ": " << r.first;
    EXPECT_TRUE(at::equal(r.second, r.expected * 2)) << "rank " << rank << ": " << r.second;
    EXPECT_TRUE(at::equal(r.after_reset, r.expected)) << "rank " << rank << ": " << r.after_reset;
  }
}

TEST_P(GradientBucketsTest, WithoutTheFlagTheRoundAddsIntoWhatTheShardHeld) {
  const auto results = RunOnEveryRank(/*writes=*/false, /*all_to_all=*/GetParam());
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_EQ(results[rank].error, "") << "rank " << rank;
    // NaN + the sum: what an owner that skipped zeroing would have got.
    EXPECT_TRUE(at::isnan(results[rank].first).all().item<bool>()) << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(GlooReduceScatter, GradientBucketsTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "AllToAll" : "C10dEmulation";
                         });

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
