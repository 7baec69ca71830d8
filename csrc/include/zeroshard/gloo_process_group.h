// Building a Gloo process group from a pure C++ program.
//
// The PyPI torch wheel exports ProcessGroupGloo but ships no gloo headers, so
// this one translation unit is compiled against Debian's libgloo-dev headers
// (declarations only: it calls nothing of gloo's, only the ProcessGroupGloo
// entry points exported by libtorch_cpu). It is built only when those headers
// are found (CMake option ZEROSHARD_WITH_GLOO); Python users never need it:
// they pass torch.distributed's group.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace zeroshard {

// A CPU process group backed by Gloo, meeting the other ranks through
// `store` (a c10d::TCPStore, FileStore or HashStore shared by all ranks).
// Blocks until every rank has joined.
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t world_size,
    std::chrono::milliseconds timeout = std::chrono::minutes(5));

// The two groups of hybrid sharding over `world_size` ranks (see
// ZeroOptimizer's hybrid constructor): shard groups of `shard_size`
// consecutive ranks (rank / shard_size picks the group, as ranks of one node
// are numbered together by torchrun), and replicate groups of the ranks with
// the same rank % shard_size. shard_size must divide world_size. `name`
// keys the groups' rendezvous in `store`: give each call on one store its own.
struct HybridGroups {
  c10::intrusive_ptr<c10d::ProcessGroup> shard;
  c10::intrusive_ptr<c10d::ProcessGroup> replicate;
};
HybridGroups make_hybrid_gloo_groups(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                     int64_t world_size, int64_t shard_size,
                                     std::chrono::milliseconds timeout = std::chrono::minutes(5),
                                     const std::string& name = "zeroshard/hybrid");

}  // namespace zeroshard
