// CollectiveAgreement: what three ranks asking differently agree on (the
// union of demands, prefetches and reductions every rank asked for, barriers
// of one kind), and that agreeing ranks need only the hash round.
#include "zeroshard/collective_agreement.h"

#ifdef ZEROSHARD_WITH_GLOO
#include "rank_threads.h"
#endif

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace zeroshard {
namespace {

#ifdef ZEROSHARD_WITH_GLOO

constexpr int kWorld = 3;
constexpr int64_t kUnits = 6;
constexpr int64_t kBuckets = 5;

using Requests = std::vector<AgreementRequest>;

// Each rank's agreement on its request; every rank must agree alike.
std::vector<Agreement> AgreeOn(const Requests& requests) {
  std::vector<Agreement> out(kWorld);
  auto errors = RunRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    Communicator comm(pg);
    comm.set_order_check_enabled(true);  // the agreement's own all-reduces skip it
    CollectiveAgreement agreement(comm, kUnits, kBuckets);
    out[rank] = agreement.agree(requests[rank]);
    EXPECT_EQ(agreement.count_rounds(), out[rank].unanimous ? 0 : 1);
  });
  for (const auto& error : errors) {
    EXPECT_EQ(error, "");
  }
  for (int rank = 1; rank < kWorld; ++rank) {
    EXPECT_EQ(out[rank].gather, out[0].gather);
    EXPECT_EQ(out[rank].reduce, out[0].reduce);
    EXPECT_EQ(out[rank].all_at_barrier, out[0].all_at_barrier);
    EXPECT_EQ(out[rank].barriers_differ, out[0].barriers_differ);
  }
  return out;
}

TEST(CollectiveAgreementTest, RanksAskingAlikeAgreeInTheHashRound) {
  AgreementRequest request;
  request.demand = {3};
  request.prefetch = {4, 1};
  request.ready = {2, 0};
  const auto agreed = AgreeOn(Requests(kWorld, request));
  EXPECT_TRUE(agreed[0].unanimous);
  EXPECT_EQ(agreed[0].gather, (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(agreed[0].reduce, (std::vector<int64_t>{0, 2}));
  EXPECT_FALSE(agreed[0].all_at_barrier);
}

TEST(CollectiveAgreementTest, DemandsUniteAndPrefetchesAndReductionsNeedEveryRank) {
  Requests requests(kWorld);
  requests[0].demand = {2};
  requests[0].prefetch = {4, 5};
  requests[0].ready = {1, 3};
  requests[1].demand = {0};
  requests[1].prefetch = {4};
  requests[1].ready = {1, 3, 4};
  requests[2].barrier = AgreementBarrier::kBackwardEnd;  // at a barrier, asking nothing
  requests[2].prefetch = {4};
  requests[2].ready = {3, 1};
  const auto agreed = AgreeOn(requests);
  EXPECT_FALSE(agreed[0].unanimous);
  // Demanded by one rank each: everyone gathers; 4 every rank would prefetch,
  // 5 only rank 0.
  EXPECT_EQ(agreed[0].gather, (std::vector<int64_t>{0, 2, 4}));
  // Bucket 4 is complete on rank 1 only: it waits.
  EXPECT_EQ(agreed[0].reduce, (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(agreed[0].all_at_barrier);
}

TEST(CollectiveAgreementTest, BarriersEndTogetherAndDifferentKindsAreFlagged) {
  Requests same(kWorld);
  for (auto& request : same) {
    request.barrier = AgreementBarrier::kForwardEnd;
  }
  same[1].ready = {2};  // not unanimous: the count round decides
  auto agreed = AgreeOn(same);
  EXPECT_TRUE(agreed[0].all_at_barrier);
  EXPECT_FALSE(agreed[0].barriers_differ);
  EXPECT_TRUE(agreed[0].reduce.empty());

  Requests mixed(kWorld);
  mixed[0].barrier = AgreementBarrier::kStep;
  mixed[1].barrier = AgreementBarrier::kForwardEnd;
  mixed[2].barrier = AgreementBarrier::kBackwardEnd;  // mean of the others: sums alone agree
  agreed = AgreeOn(mixed);
  EXPECT_TRUE(agreed[0].all_at_barrier);
  EXPECT_TRUE(agreed[0].barriers_differ);
}

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
