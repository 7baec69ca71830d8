// agree_on_error: a failure on one rank of one group becomes the same error on
// every rank of every group of the scope; no failure is "" everywhere.
#include "zeroshard/error_agreement.h"

#ifdef ZEROSHARD_WITH_GLOO
#include "rank_threads.h"
#endif

#include <gtest/gtest.h>

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
      std::string out =
          agree_on_error({{&comm, ""}, {nullptr, "unused/"}}, mine, c10::Device(c10::kCPU), "test");
      std::lock_guard<std::mutex> lock(mutex);
      agreed[rank] = out;
    });
    for (int rank = 0; rank < 3; ++rank) {
      EXPECT_EQ(errors[rank], "");
      EXPECT_EQ(agreed[rank], fail ? "(1 of 3 ranks failed): rank 2: cannot open swap file" : "");
    }
  }
}

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
