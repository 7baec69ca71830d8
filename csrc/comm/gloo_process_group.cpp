// See gloo_process_group.h for why this file is separate.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include "zeroshard/gloo_process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <string>

namespace zeroshard {

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t world_size,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(world_size >= 1, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "rank must be in [0, ", world_size, "), got ",
                    rank);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank),
                                                             static_cast<int>(world_size), options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, static_cast<int>(rank),
                                                       static_cast<int>(world_size));
  // Gloo serves CPU tensors, and CUDA tensors by staging them through host
  // memory where torch was built with CUDA.
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  return group;
}

HybridGroups make_hybrid_gloo_groups(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                     int64_t world_size, int64_t shard_size,
                                     std::chrono::milliseconds timeout, const std::string& name) {
  TORCH_CHECK_VALUE(shard_size >= 1 && world_size % shard_size == 0,
                    "hybrid sharding needs a shard group size that divides the world size ",
                    world_size, "; got ", shard_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "rank must be in [0, ", world_size, "), got ",
                    rank);
  const int64_t shard_group = rank / shard_size;  // also the rank among replicas
  const int64_t rank_in_shard = rank % shard_size;
  // Each group meets through its own key space of the one store.
  auto shard_store =
      c10::make_intrusive<c10d::PrefixStore>(name + "/shard" + std::to_string(shard_group), store);
  auto replicate_store = c10::make_intrusive<c10d::PrefixStore>(
      name + "/replicate" + std::to_string(rank_in_shard), store);
  HybridGroups groups;
  groups.shard = make_gloo_process_group(shard_store, rank_in_shard, shard_size, timeout);
  groups.replicate =
      make_gloo_process_group(replicate_store, shard_group, world_size / shard_size, timeout);
  return groups;
}

}  // namespace zeroshard
