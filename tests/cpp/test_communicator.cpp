// Communicator: a Work the backend's worker thread still references when
// wait() returns is destroyed on the caller's thread, never on the worker's
// (see [Note: Work dies on the caller's thread] in communicator.h); the
// all-gather done as broadcasts on Gloo; the byte counts.
#include "zeroshard/communicator.h"

#ifdef ZEROSHARD_WITH_GLOO
#include "rank_threads.h"
#endif

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

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

// [Note: an all-gather as broadcasts]: the same values as Gloo's allgather, at
// a world size that divides nothing, for an input of its own and for the
// output's own slice, in fp32 and bf16; the same bytes counted; and every
// broadcast's Work retired on this thread.
TEST(CommunicatorTest, AllGatherAsBroadcastsEqualsGlooAllgather) {
  constexpr int kWorld = 3;
  constexpr int64_t kSlice = 1237;
  std::vector<std::string> failures(kWorld);
  auto errors = RunRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    std::string& failure = failures[rank];
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      for (const bool in_place : {false, true}) {
        std::vector<at::Tensor> outputs;
        std::vector<int64_t> bytes;
        for (const bool broadcasts : {true, false}) {
          Communicator comm(pg);
          comm.set_all_gather_broadcasts(broadcasts);
          at::Tensor output = at::full({kSlice * kWorld}, -1.0, dtype);
          // Each rank's slice differs from every other's, element by element.
          at::Tensor mine = (at::arange(kSlice, at::kFloat) * 0.37 + rank * 1000).to(dtype);
          at::Tensor input = mine;
          if (in_place) {
            input = output.narrow(0, rank * kSlice, kSlice);
            input.copy_(mine);
          }
          comm.all_gather(output, input, "gather").wait();
          comm.release_finished_work();
          outputs.push_back(output);
          bytes.push_back(comm.stats().all_gather_bytes);
        }
        // The Communicators are gone: nothing else holds the output's storage.
        const std::string what = std::string(c10::toString(dtype)) +
                                 (in_place ? ", in place" : ", separate input") + ": ";
        if (!at::equal(outputs[0], outputs[1])) {
          failure += what + "broadcasts and allgather differ; ";
        }
        for (int r = 0; r < kWorld; ++r) {
          at::Tensor expected = (at::arange(kSlice, at::kFloat) * 0.37 + r * 1000).to(dtype);
          if (!at::equal(outputs[0].narrow(0, r * kSlice, kSlice), expected)) {
            failure += what + "slice " + std::to_string(r) + " is wrong; ";
          }
        }
        if (bytes[0] != bytes[1] || bytes[0] != outputs[0].numel() * outputs[0].element_size()) {
          failure += what + "bytes counted " + std::to_string(bytes[0]) + " and " +
                     std::to_string(bytes[1]) + "; ";
        }
        if (outputs[0].storage().use_count() != 1) {
          failure += what + "a Work still holds the output; ";
        }
      }
    }
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_EQ(failures[rank], "") << "rank " << rank;
  }
}

// [Note: the host channel]: host data (signatures, flags, strings) gives the
// same answers over the group itself, over a channel of its own and through
// the device; only the last is counted as host syncs, once per exchange.
TEST(CommunicatorTest, HostDataCostsNoHostSyncOverAHostChannel) {
  constexpr int kWorld = 3;
  std::vector<std::string> failures(kWorld);
  auto errors = RunRankThreads(kWorld, [&](int rank, const c10::intrusive_ptr<c10d::Store>& store) {
    auto data = make_gloo_process_group(c10::make_intrusive<c10d::PrefixStore>("data", store), rank,
                                        kWorld, std::chrono::seconds(60));
    auto channel = make_gloo_process_group(c10::make_intrusive<c10d::PrefixStore>("channel", store),
                                           rank, kWorld, std::chrono::seconds(60));
    HostSyncCounter syncs;
    Communicator comm(data);
    comm.set_host_sync_counter(&syncs);
    std::string& failure = failures[rank];
    auto exchange = [&](const std::string& how, int64_t expected_syncs) {
      const int64_t before = syncs.total();
      const auto [largest, smallest] = comm.extremes(10 + rank, how + "/extremes");
      at::Tensor flags = at::full({4}, rank, at::kInt);
      comm.all_reduce_on_host(flags, c10d::ReduceOp::SUM, how + "/flags");
      at::Tensor mine = at::full({2}, rank, at::kLong);
      at::Tensor all = at::empty({2 * kWorld}, at::kLong);
      comm.all_gather_on_host(all, mine, how + "/gather");
      if (largest != 10 + kWorld - 1 || smallest != 10) {
        failure +=
            how + ": extremes " + std::to_string(largest) + ", " + std::to_string(smallest) + "; ";
      }
      if (!at::equal(flags, at::full({4}, kWorld * (kWorld - 1) / 2, at::kInt))) {
        failure += how + ": the sum is wrong; ";
      }
      for (int r = 0; r < kWorld; ++r) {
        if (all[2 * r].item<int64_t>() != r || all[2 * r + 1].item<int64_t>() != r) {
          failure += how + ": rank " + std::to_string(r) + "'s gathered values are wrong; ";
        }
      }
      if (!flags.is_cpu() || !all.is_cpu()) {
        failure += how + ": host data left the host; ";
      }
      if (syncs.total() - before != expected_syncs) {
        failure += how + ": " + std::to_string(syncs.total() - before) + " host syncs, expected " +
                   std::to_string(expected_syncs) + "; ";
      }
    };
    EXPECT_TRUE(comm.has_host_channel());  // a Gloo group is its own channel
    exchange("own", 0);
    comm.set_host_channel(channel);
    exchange("channel", 0);
    comm.clear_host_channel();  // as an NCCL group without one
    exchange("device", 3);
    if (syncs.count_of(HostSync::kHostDataOnDevice) != 3) {
      failure += "the syncs were not counted as host_data_on_device; ";
    }
    EXPECT_THROW(comm.set_host_channel(make_gloo_process_group(
                     c10::make_intrusive<c10d::PrefixStore>("small" + std::to_string(rank), store),
                     0, 1, std::chrono::seconds(60))),
                 c10::ValueError);
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_EQ(failures[rank], "") << "rank " << rank;
  }
}

// What the engine's telemetry reads: a user's reset_stats() zeroes stats()
// and leaves lifetime_stats(), so a telemetry line's difference of two
// lifetime counts cannot go negative.
TEST(CommunicatorTest, ResetStatsLeavesLifetimeStats) {
  constexpr int kWorld = 2;
  std::vector<std::string> failures(kWorld);
  auto errors = RunRanks(kWorld, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    Communicator comm(pg);
    at::Tensor tensor = at::ones({4});
    comm.all_reduce_sum(tensor, "first");
    comm.reset_stats();
    comm.all_reduce_sum(tensor, "second");
    if (comm.stats().all_reduce_bytes != 16 || comm.stats().calls != 1) {
      failures[rank] += "stats() after the reset counts " +
                        std::to_string(comm.stats().all_reduce_bytes) + " bytes; ";
    }
    if (comm.lifetime_stats().all_reduce_bytes != 32 || comm.lifetime_stats().calls != 2) {
      failures[rank] += "lifetime_stats() counts " +
                        std::to_string(comm.lifetime_stats().all_reduce_bytes) + " bytes; ";
    }
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_EQ(failures[rank], "") << "rank " << rank;
  }
}

#endif  // ZEROSHARD_WITH_GLOO

// A rank sends B(N-1)/N of a reduce-scatter, all-gather or broadcast of B
// bytes and twice that of an all-reduce (the ring algorithms' count).
TEST(CommStatsTest, WireBytesAreTheRingCount) {
  CommStats stats;
  stats.all_reduce_bytes = 16;
  stats.reduce_scatter_bytes = 400;
  stats.all_gather_bytes = 400;
  stats.broadcast_bytes = 40;
  EXPECT_DOUBLE_EQ(stats.wire_bytes(4), 0.75 * (2 * 16 + 400 + 400 + 40));
  EXPECT_DOUBLE_EQ(stats.wire_bytes(2), 0.5 * (2 * 16 + 400 + 400 + 40));
  EXPECT_DOUBLE_EQ(stats.wire_bytes(1), 0.0);
}

}  // namespace
}  // namespace zeroshard
