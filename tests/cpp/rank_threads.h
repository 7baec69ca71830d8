// Ranks as threads of one test process, meeting over a HashStore with real
// Gloo process groups (as PyTorch's own c10d C++ tests do).
#pragma once

#ifdef ZEROSHARD_WITH_GLOO

#include "zeroshard/gloo_process_group.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace zeroshard {

// Runs fn(rank, group) on `world` threads; returns each rank's error message
// ("" when it succeeded).
inline std::vector<std::string> RunRanks(
    int world, const std::function<void(int, c10::intrusive_ptr<c10d::ProcessGroup>)>& fn) {
  // torch's FlightRecorder (one per process) reads its per-group status map
  // before taking its lock, so Gloo groups enqueueing from several threads at
  // once can crash inside torch. Ranks as processes don't share it; ranks as
  // threads turn it off before the first group exists.
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1);
  auto store = c10::make_intrusive<c10d::HashStore>();
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
        auto group = make_gloo_process_group(store, rank, world, std::chrono::seconds(60));
        fn(rank, group);
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

}  // namespace zeroshard

#endif  // ZEROSHARD_WITH_GLOO
