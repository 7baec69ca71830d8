// Ranks as threads of one test process, meeting over a HashStore with real
// Gloo process groups (as PyTorch's own c10d C++ tests do).
#pragma once

#ifdef ZEROSHARD_WITH_GLOO

#include "zeroshard/gloo_process_group.h"

#include <ATen/Parallel.h>
#include <ATen/ops/randn.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace zeroshard {

// [Note: first matmul in concurrent threads]
// In a fresh process, the first CPU matmuls issued concurrently from several
// threads can take another numeric path (an ulp apart) than every later call:
// measured in 5 of 100 fresh processes with two threads each running the
// test model's forward and backward (0 of 100 with one thread, 0 of 100 after
// one warm-up on the main thread). Adam turns that ulp into ~5e-6 after 8
// steps, which made SaveLoadContinueEqualsUninterrupted (two fresh trainings
// compared bit for bit) fail about 1 run in 20. Ranks as processes (torchrun)
// never share a process; ranks as threads warm ATen up once, here, before the
// first thread starts.
inline void WarmUpAtenOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    at::Tensor w = at::randn({6, 5}).set_requires_grad(true);
    w.matmul(at::randn({5, 7})).tanh().sum().backward();
  });
}

// Runs body(rank, store) on `world` threads sharing one store; returns each
// rank's error message ("" when it succeeded).
inline std::vector<std::string> RunRankThreads(
    int world, const std::function<void(int, const c10::intrusive_ptr<c10d::Store>&)>& body) {
  WarmUpAtenOnce();
  // torch's FlightRecorder (one per process) reads its per-group status map
  // before taking its lock, so Gloo groups enqueueing from several threads at
  // once can crash inside torch. Ranks as processes don't share it; ranks as
  // threads turn it off before the first group exists.
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank]() {
      // One intra-op thread per rank, as torchrun gives each rank process
      // (OMP_NUM_THREADS=1): ranks as threads would otherwise share ATen's
      // pool and MKL's threads, and a kernel's chunking (so its rounding)
      // could depend on what the other ranks run at the same moment.
      at::set_num_threads(1);
      try {
        body(rank, store);
      } catch (const c10::Error& e) {
        errors[rank] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  return errors;
}

// Runs fn(rank, group) on `world` threads; returns each rank's error message
// ("" when it succeeded).
inline std::vector<std::string> RunRanks(
    int world, const std::function<void(int, c10::intrusive_ptr<c10d::ProcessGroup>)>& fn) {
  return RunRankThreads(world, [&](int rank, const c10::intrusive_ptr<c10d::Store>& store) {
    fn(rank, make_gloo_process_group(store, rank, world, std::chrono::seconds(60)));
  });
}

// Hybrid sharding: fn(rank, groups) with shard groups of `shard_size` ranks.
inline std::vector<std::string> RunHybridRanks(int world, int shard_size,
                                               const std::function<void(int, HybridGroups)>& fn) {
  return RunRankThreads(world, [&](int rank, const c10::intrusive_ptr<c10d::Store>& store) {
    fn(rank, make_hybrid_gloo_groups(store, rank, world, shard_size, std::chrono::seconds(60)));
  });
}

}  // namespace zeroshard

#endif  // ZEROSHARD_WITH_GLOO
