// Communicator: a Work the backend's worker thread still references when
// wait() returns is destroyed on the caller's thread, never on the worker's
// (see [Note: Work dies on the caller's thread] in communicator.h).
#include "zeroshard/communicator.h"

#ifdef ZEROSHARD_WITH_GLOO
#include "rank_threads.h"
#endif

#include <ATen/ops/ones.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace zeroshard {
namespace {

#ifdef ZEROSHARD_WITH_GLOO

TEST(CommunicatorTest, WaitedWorkIsReleasedOnTheCallersThread) {
  constexpr int kWorld = 2;
  constexpr int kCollectives = 200;
  std::vector<int64_t> leftover_uses(kWorld, -1);
  std::vector<double> sums(kWorld, -1);
  auto errors = RunRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    std::vector<at::Tensor> inputs;
    {
      Communicator comm(pg);
      for (int i = 0; i < kCollectives; ++i) {
        at::Tensor input = at::ones({8}) * (rank + 1);
        at::Tensor output = at::empty({16});
        comm.all_gather(output, input, "gather" + std::to_string(i)).wait();
        sums[rank] = output.sum().item<double>();
        inputs.push_back(input);
      }
      // Works still shared with Gloo's worker stay retired until it lets go.
      comm.release_finished_work();
    }
    // The Communicator is gone: no Work references the tensors any more, so
    // nothing is left for a worker thread to free.
    int64_t uses = 0;
    for (const auto& input : inputs) {
      uses = std::max<int64_t>(uses, input.use_count());
    }
    leftover_uses[rank] = uses;
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_EQ(sums[rank], 8 * 1 + 8 * 2) << "rank " << rank;
    EXPECT_EQ(leftover_uses[rank], 1) << "rank " << rank;
  }
}

#endif  // ZEROSHARD_WITH_GLOO

}  // namespace
}  // namespace zeroshard
