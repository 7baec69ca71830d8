// agree_on_error: a failure on one rank of one group becomes the same error on
// every rank of every group of the scope; no failure is "" everywhere.
#include "zeroshard/error_agreement.h"
#include "zeroshard/process_groups.h"

#ifdef ZEROSHARD_WITH_GLOO
#include "rank_threads.h"
#endif

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace zeroshard {
namespace {

TEST(ErrorAgreementTest, CombinedErrorNamesTheFailedRanks) {
  EXPECT_EQ(combined_error({"", "", ""}), "");
  EXPECT_EQ(combined_error({"", "disk full", ""}), "(1 of 3 ranks failed): rank 1: disk full");
  EXPECT_EQ(combined_error({"a", "", "b"}), "(2 of 3 ranks failed): rank 0: a; rank 2: b");
  EXPECT_EQ(combined_error({"x", "x"}), "(2 of 2 ranks failed): every rank: x");
  EXPECT_EQ(combined_error({"x", "", "x", "y"}),
            "(3 of 4 ranks failed): rank 0 and rank 2: x; rank 3: y");
}

#ifdef ZEROSHARD_WITH_GLOO

// Three ranks, each its own "replica" group of one beside the shared group:
// the second group of the scope must carry the first group's agreement.
TEST(ErrorAgreementTest, EveryRankOfTheScopeGetsTheSameError) {
  for (const bool fail : {false, true}) {
    std::mutex mutex;
    std::vector<std::string> agreed(3);
    const auto errors = RunRanks(3, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
      Communicator comm(pg);
      const std::string mine = fail && rank == 2 ? "cannot open swap file" : "";
      std::string out = agree_on_error({{&comm, ""}, {nullptr, "unused/"}}, mine, "test");
      std::lock_guard<std::mutex> lock(mutex);
      agreed[rank] = out;
    });
    for (int rank = 0; rank < 3; ++rank) {
      EXPECT_EQ(errors[rank], "");
      EXPECT_EQ(agreed[rank], fail ? "(1 of 3 ranks failed): rank 2: cannot open swap file" : "");
    }
  }
}

// Four ranks: shard groups {0, 1} and {2, 3}, replicas {0, 2} and {1, 3}.
// Each failed rank is named once, by its place in both groups, in one flat
// message on every rank (not the shard group's agreement quoted inside the
// replicas'); n counts every rank of the scope.
TEST(ErrorAgreementTest, FailuresAcrossGroupsAreNamedOnceByTheirPlaceInEach) {
  std::mutex mutex;
  std::vector<std::string> agreed(4);
  std::vector<std::string> raised(4);
  const auto errors = RunHybridRanks(4, 2, [&](int rank, HybridGroups hybrid) {
    ProcessGroups groups(std::make_unique<Communicator>(hybrid.shard),
                         std::make_unique<Communicator>(hybrid.replicate));
    const std::string mine = rank == 1 ? "disk full" : rank == 2 ? "no such file" : "";
    std::string out = groups.agree(mine, "test");
    std::string thrown;
    try {
      groups.raise_if_any_failed(mine, "open the swap file", "test_raise");
    } catch (const c10::Error& e) {
      thrown = e.what_without_backtrace();
    }
    std::lock_guard<std::mutex> lock(mutex);
    agreed[rank] = out;
    raised[rank] = thrown;
  });
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(errors[rank], "");
    EXPECT_EQ(agreed[rank],
              "(2 of 4 ranks failed): shard rank 1, replica 0: disk full; shard rank 0, "
              "replica 1: no such file");
  }
  EXPECT_EQ(raised[1], "disk full");
  EXPECT_EQ(raised[2], "no such file");
  EXPECT_NE(raised[0].find("another rank failed to open the swap file; failing here too instead "
                           "of waiting for it: (2 of 4 ranks failed): shard rank 1, replica 0"),
            std::string::npos)
      << raised[0];
  EXPECT_EQ(raised[0], raised[3]);
}

// Every rank of both groups failing alike is said once.
TEST(ErrorAgreementTest, EveryRankOfEveryGroupFailingAlikeIsSaidOnce) {
  std::mutex mutex;
  std::vector<std::string> agreed(4);
  RunHybridRanks(4, 2, [&](int rank, HybridGroups hybrid) {
    ProcessGroups groups(std::make_unique<Communicator>(hybrid.shard),
                         std::make_unique<Communicator>(hybrid.replicate));
    std::string out = groups.agree("bad \n path: a", "test");
    std::lock_guard<std::mutex> lock(mutex);
    agreed[rank] = out;
  });
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(agreed[rank], "(4 of 4 ranks failed): every rank: bad \n path: a");
  }
}

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
