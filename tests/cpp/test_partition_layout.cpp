#include "zeroshard/partition_layout.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace zeroshard {
namespace {

// Every element of every parameter is owned by exactly one rank, shards are
// equal, buckets are padded by less than world_size.
void ExpectExactCover(const GroupLayout& layout, const std::vector<int64_t>& numels) {
  const int64_t world = layout.world_size();
  EXPECT_EQ(layout.flat_numel() % world, 0);
  std::vector<std::vector<int>> owners(numels.size());
  for (size_t i = 0; i < numels.size(); ++i) {
    owners[i].assign(numels[i], 0);
  }
  for (int64_t rank = 0; rank < world; ++rank) {
    int64_t previous_end = 0;
    for (const auto& segment : layout.segments_of_rank(rank)) {
      EXPECT_GE(segment.shard_offset, previous_end) << "segments overlap in the shard";
      previous_end = segment.shard_offset + segment.numel;
      EXPECT_LE(previous_end, layout.shard_numel());
      for (int64_t e = 0; e < segment.numel; ++e) {
        owners[segment.param_index][segment.param_offset + e] += 1;
      }
    }
  }
  for (size_t i = 0; i < numels.size(); ++i) {
    for (int64_t e = 0; e < numels[i]; ++e) {
      ASSERT_EQ(owners[i][e], 1) << "param " << i << " element " << e;
    }
  }
  int64_t real = 0;
  for (auto n : numels) {
    real += n;
  }
  EXPECT_EQ(layout.param_numel(), real);
  // [Note: aligned slots]: every slot and every rank's slice starts aligned;
  // a gap between slots is less than the alignment, a bucket's tail less
  // than world_size x alignment.
  const int64_t align = layout.alignment();
  for (const auto& bucket : layout.buckets()) {
    EXPECT_EQ(bucket.numel % (world * align), 0);
    EXPECT_EQ(bucket.flat_offset % align, 0);
    EXPECT_EQ(bucket.shard_offset % align, 0);
    int64_t end = bucket.flat_offset;
    for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
      const ParamSlot& slot = layout.slots()[s];
      if (slot.numel == 0) {
        continue;
      }
      EXPECT_EQ(slot.flat_offset % align, 0) << "slot " << s << " is not aligned";
      EXPECT_GE(slot.flat_offset, end) << "slots overlap";
      EXPECT_LT(slot.flat_offset - end, align) << "a gap of a whole alignment or more";
      end = slot.flat_offset + slot.numel;
    }
    EXPECT_LT(bucket.flat_offset + bucket.numel - end, world * align)
        << "padding must be < world_size x alignment";
  }
}

TEST(PartitionLayoutTest, OneBucketGivesEachRankOneContiguousEqualSlice) {
  GroupLayout layout({5, 3, 7}, /*world_size=*/4, /*bucket_numel=*/1000);
  ASSERT_EQ(layout.buckets().size(), 1u);
  EXPECT_EQ(layout.flat_numel(), 16);  // 15 padded to a multiple of 4
  EXPECT_EQ(layout.shard_numel(), 4);
  // Reverse registration order: the last parameter comes first.
  EXPECT_EQ(layout.slot_of_param(2).flat_offset, 0);
  EXPECT_EQ(layout.slot_of_param(1).flat_offset, 7);
  EXPECT_EQ(layout.slot_of_param(0).flat_offset, 10);
  // Rank 1 owns flat [4, 8): param 2 elements 4..6 and param 1 element 0.
  auto segments = layout.segments_of_rank(1);
  ASSERT_EQ(segments.size(), 2u);
  EXPECT_EQ(segments[0].param_index, 2);
  EXPECT_EQ(segments[0].param_offset, 4);
  EXPECT_EQ(segments[0].numel, 3);
  EXPECT_EQ(segments[1].param_index, 1);
  EXPECT_EQ(segments[1].param_offset, 0);
  EXPECT_EQ(segments[1].shard_offset, 3);
  ExpectExactCover(layout, {5, 3, 7});
}

TEST(PartitionLayoutTest, EmptyTensorsAndTensorsSmallerThanTheWorld) {
  const std::vector<int64_t> numels{0, 1, 0, 2, 1};
  GroupLayout layout(numels, /*world_size=*/4, /*bucket_numel=*/1000);
  EXPECT_EQ(layout.flat_numel(), 4);
  EXPECT_EQ(layout.shard_numel(), 1);
  ExpectExactCover(layout, numels);
}

TEST(PartitionLayoutTest, AllEmptyGroupHasNoBuckets) {
  GroupLayout layout({0, 0}, /*world_size=*/3, /*bucket_numel=*/8);
  EXPECT_EQ(layout.flat_numel(), 0);
  EXPECT_EQ(layout.shard_numel(), 0);
  EXPECT_TRUE(layout.buckets().empty());
  EXPECT_TRUE(layout.segments_of_rank(2).empty());
}

TEST(PartitionLayoutTest, ParameterLargerThanBucketGetsItsOwnBucket) {
  GroupLayout layout({3, 50, 4}, /*world_size=*/3, /*bucket_numel=*/10);
  ASSERT_EQ(layout.buckets().size(), 3u);
  EXPECT_EQ(layout.buckets()[1].numel, 51);
  EXPECT_EQ(layout.buckets()[1].shard_offset, layout.buckets()[0].shard_numel);
  ExpectExactCover(layout, {3, 50, 4});
}

TEST(PartitionLayoutTest, UnevenSizesAcrossWorldSizesAndBucketSizes) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> size(0, 40);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int64_t> numels(1 + trial % 9);
    for (auto& n : numels) {
      n = size(rng);
    }
    for (int64_t world : {1, 2, 3, 4, 5, 7}) {
      for (int64_t bucket : {1, 5, 16, 1000}) {
        GroupLayout layout(numels, world, bucket);
        ExpectExactCover(layout, numels);
      }
    }
  }
}

TEST(PartitionLayoutTest, AlignedSlotsAcrossSizesWorldsAndBuckets) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int64_t> size(0, 40);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int64_t> numels(1 + trial % 9);
    for (auto& n : numels) {
      n = size(rng);
    }
    for (int64_t align : {2, 4, 8, 16}) {
      for (int64_t world : {1, 2, 3, 5, 7}) {
        for (int64_t bucket : {1, 5, 16, 1000}) {
          GroupLayout layout(numels, world, bucket, {}, align);
          ExpectExactCover(layout, numels);
        }
      }
    }
  }
}

TEST(PartitionLayoutTest, AlignmentIsSixteenBytesInTheParametersDtype) {
  EXPECT_EQ(alignment_in_elements(2), 8);  // bf16, fp16
  EXPECT_EQ(alignment_in_elements(4), 4);  // fp32
  EXPECT_EQ(alignment_in_elements(1), 16);
  EXPECT_EQ(alignment_in_elements(8), 2);
  // A 3-element bf16 parameter no longer pushes the next one off alignment.
  GroupLayout layout({3, 5, 7}, 2, 1000, {}, alignment_in_elements(2));
  EXPECT_EQ(layout.slot_of_param(2).flat_offset, 0);  // reverse registration order
  EXPECT_EQ(layout.slot_of_param(1).flat_offset, 8);
  EXPECT_EQ(layout.slot_of_param(0).flat_offset, 16);
  EXPECT_EQ(layout.flat_numel(), 32);  // 19 rounded up to 2 ranks x 8
  EXPECT_EQ(layout.shard_numel(), 16);
  EXPECT_NE(PartitionLayout({{3, 5}}, 2, 1000, {}, {8}).fingerprint(),
            PartitionLayout({{3, 5}}, 2, 1000).fingerprint());
}

// [Note: whole parameters]: each parameter lies in one rank's slice, every
// element is owned once, slices are even (LPT), and the layout is told apart
// from the elementwise one.
TEST(PartitionLayoutTest, WholeParametersEachHaveOneOwner) {
  const std::vector<int64_t> numels = {78, 78, 10, 40, 0, 96, 3};
  for (int64_t world : {1, 2, 3, 5, 8}) {
    for (int64_t bucket : {1, 100, 1000}) {
      for (int64_t align : {1, 4}) {
        GroupLayout layout(numels, world, bucket, {}, align, /*whole_parameters=*/true);
        std::vector<int64_t> owners(numels.size(), 0);
        for (int64_t rank = 0; rank < world; ++rank) {
          for (const auto& segment : layout.segments_of_rank(rank)) {
            EXPECT_EQ(segment.param_offset, 0) << "world " << world << " bucket " << bucket;
            EXPECT_EQ(segment.numel, numels[segment.param_index]);
            owners[segment.param_index] += 1;
          }
        }
        for (size_t i = 0; i < numels.size(); ++i) {
          EXPECT_EQ(owners[i], numels[i] > 0 ? 1 : 0) << "param " << i << " world " << world;
        }
        int64_t shard_total = 0;
        for (const auto& b : layout.buckets()) {
          EXPECT_EQ(b.numel, b.shard_numel * world);
          EXPECT_EQ(b.shard_numel % align, 0);
          // LPT: no slice exceeds the ideal by more than its largest parameter.
          int64_t sum = 0;
          int64_t largest = 0;
          for (int64_t s = b.first_slot; s < b.end_slot; ++s) {
            const int64_t n = (layout.slots()[s].numel + align - 1) / align * align;
            sum += n;
            largest = std::max(largest, n);
            EXPECT_EQ(layout.slot_of_param(layout.slots()[s].param_index).flat_offset,
                      layout.slots()[s].flat_offset);
            if (s > b.first_slot) {
              EXPECT_GE(layout.slots()[s].flat_offset, layout.slots()[s - 1].flat_offset);
            }
          }
          EXPECT_LE(b.shard_numel, std::max(align, (sum + world - 1) / world + largest));
          shard_total += b.shard_numel;
        }
        EXPECT_EQ(shard_total, layout.shard_numel());
        EXPECT_NE(GroupLayout(numels, world, bucket, {}, align, true).fingerprint(0),
                  GroupLayout(numels, world, bucket, {}, align, false).fingerprint(0));
      }
    }
  }
  // Matrices larger than the bucket size share a bucket of room for one per
  // rank: sharded, not each alone in a bucket padded on every other rank.
  GroupLayout large({1000, 1000, 1000, 1000}, 4, 100, {}, 4, true);
  EXPECT_EQ(large.buckets().size(), 1u);
  EXPECT_EQ(large.shard_numel(), 1000);
  EXPECT_EQ(large.flat_numel(), 4000);
  // Two equal matrices on two ranks: one each, nothing padded.
  GroupLayout even({64, 64}, 2, 1000, {}, 4, true);
  EXPECT_EQ(even.flat_numel(), 128);
  EXPECT_EQ(even.segments_of_rank(0).size(), 1u);
  EXPECT_EQ(even.segments_of_rank(1).size(), 1u);
}

namespace {

// The work each rank owns in a whole-parameter layout.
std::vector<double> owned_costs(const GroupLayout& layout, const std::vector<double>& costs) {
  std::vector<double> owned(layout.world_size(), 0.0);
  for (int64_t rank = 0; rank < layout.world_size(); ++rank) {
    for (const auto& segment : layout.segments_of_rank(rank)) {
      owned[rank] += costs[segment.param_index];
    }
  }
  return owned;
}

}  // namespace

// [Note: whole parameters]: the owners are balanced over all buckets by the
// rule's work, at the padding each bucket's slices need anyway.
TEST(PartitionLayoutTest, WholeParameterOwnersBalanceWorkAcrossBuckets) {
  // Stage 3, one matrix per unit: each bucket has one non-empty slice. It
  // went to rank 0 in every bucket; now to each rank in turn.
  const std::vector<int64_t> numels = {96, 96, 96, 96, 96, 96, 96, 96};
  const std::vector<int64_t> units = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int64_t world : {2, 3, 4, 8}) {
    GroupLayout layout(numels, world, 1000, units, 4, /*whole_parameters=*/true);
    const std::vector<double> costs(numels.begin(), numels.end());
    const std::vector<double> owned = owned_costs(layout, costs);
    const auto [low, high] = std::minmax_element(owned.begin(), owned.end());
    EXPECT_LE(*high - *low, 96.0) << "world " << world;  // at most one matrix apart
    // The same padding as before: every bucket one matrix per slice.
    EXPECT_EQ(layout.flat_numel(), 8 * 96 * world) << "world " << world;
  }
  // Equal sizes, unequal work (Muon's m * n * min(m, n): a 4x24 and a 12x8
  // matrix both hold 96 elements, and cost 384 and 768): the costly ones
  // spread over the ranks, not only the large ones.
  const std::vector<double> costs = {384, 768, 384, 768, 384, 768, 384, 768};
  GroupLayout by_cost(numels, 2, 1000, units, 4, true, costs);
  const std::vector<double> owned = owned_costs(by_cost, costs);
  EXPECT_EQ(owned[0], owned[1]);
  GroupLayout by_size(numels, 2, 1000, units, 4, true);
  EXPECT_NE(by_cost.fingerprint(0), by_size.fingerprint(0)) << "costs moved parameters";
  EXPECT_EQ(by_cost.flat_numel(), by_size.flat_numel());
  EXPECT_THROW(GroupLayout(numels, 2, 1000, units, 4, true, {1.0}), c10::ValueError);
  // Over groups too (per-layer Muon groups): each group's one matrix went to
  // rank 0; now they take turns.
  PartitionLayout groups({{96}, {96}, {96}, {96}}, 2, 1000, {}, {4, 4, 4, 4},
                         {true, true, true, true});
  int64_t on_rank_one = 0;
  for (const GroupLayout& group : groups.groups()) {
    on_rank_one += group.segments_of_rank(1).empty() ? 0 : 1;
  }
  EXPECT_EQ(on_rank_one, 2);
  EXPECT_EQ(groups.groups().back().rank_costs(), (std::vector<double>{192, 192}));
}

TEST(PartitionLayoutTest, SeveralGroupsAndFingerprints) {
  PartitionLayout a({{4, 5}, {6}}, 2, 1000);
  PartitionLayout same({{4, 5}, {6}}, 2, 1000);
  PartitionLayout regrouped({{4}, {5, 6}}, 2, 1000);
  PartitionLayout other_world({{4, 5}, {6}}, 3, 1000);
  PartitionLayout other_bucket({{4, 5}, {6}}, 2, 4);
  ASSERT_EQ(a.groups().size(), 2u);
  EXPECT_EQ(a.group(0).flat_numel(), 10);
  EXPECT_EQ(a.group(1).flat_numel(), 6);
  EXPECT_EQ(a.fingerprint(), same.fingerprint());
  EXPECT_NE(a.fingerprint(), regrouped.fingerprint());
  EXPECT_NE(a.fingerprint(), other_world.fingerprint());
  EXPECT_NE(a.fingerprint(), other_bucket.fingerprint());
}

TEST(PartitionLayoutTest, RejectsInvalidArguments) {
  EXPECT_THROW(GroupLayout({1}, 0, 10), c10::ValueError);
  EXPECT_THROW(GroupLayout({1}, 2, 0), c10::ValueError);
  EXPECT_THROW(GroupLayout({-1}, 2, 10), c10::ValueError);
  EXPECT_THROW(GroupLayout({1}, 2, 10, {}, 0), c10::ValueError);
}

}  // namespace
}  // namespace zeroshard
