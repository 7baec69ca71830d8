// Host memory that goes back to the system the moment it is freed.
//
// glibc serves a large malloc with mmap only above its mmap threshold, and it
// raises that threshold (up to 32 MiB) each time such a block is freed; after
// that, freed blocks of the same size stay in the heap and in the process's
// RSS. The library's own large, short-lived host buffers (gathered stage-3
// units and reduce-scatter staging on a CPU device, NVMe parameter transfer
// buffers) therefore come from anonymous mappings of their own: page aligned
// (what O_DIRECT needs) and unmapped when the last reference goes, whatever
// the allocator's thresholds or the environment.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>

namespace zeroshard {

// A c10::Allocator over anonymous mappings (sizes rounded up to the page);
// allocate(0) gives a null pointer. Thread-safe; lives for the process.
c10::Allocator* mapped_host_allocator();

// A 1D CPU tensor of `numel` elements whose storage is such a mapping (its
// memory reads as zeros until written).
at::Tensor mapped_host_empty(int64_t numel, c10::ScalarType dtype);

// The library's buffers that come and go during training (gathered stage-3
// units here; the step's recurring buffers through HostBufferPool below):
// 1D, `numel` elements of `options`; on the CPU (not pinned) and at least
// kMappedBufferBytes large, a mapping of its own, at::empty otherwise
// (small blocks are reused from the heap at no cost in RSS).
constexpr int64_t kMappedBufferBytes = int64_t{256} << 10;
at::Tensor empty_buffer(int64_t numel, const at::TensorOptions& options);

// [Note: recycled step buffers]
// Some of those buffers recur every step at the same sizes: gradient staging,
// all-to-all receive rows, reduce-scatter outputs.
// A fresh mapping per use faults its pages in again every step: 20K faults a
// step at stage 2 on a 29M-parameter GPT on 2 CPU ranks, against 5K for DDP,
// whose buckets persist (counted once with perf stat, outside the repo).
// A pool keeps the mappings its buffers free and hands the smallest that
// fits (at most twice the request) to the next request: bucket sizes differ
// a little, cut at parameter boundaries. A larger one goes to the request
// too when mapping a new one would need room made by unmapping: with the
// 2x rule alone a step's mix of sizes (buckets and their shards) made the
// pool unmap and map again ~70 MB a step per rank, every step. What it
// holds plus what is out never exceeds its buffers' high-water mark, so it
// holds at rest (between steps, while the next forward runs) up to what one
// step had out at once, as CUDA's caching allocator would; clear() gives that
// back. Gathered stage-3 units must leave the process when released and do
// not come from a pool; the stage-1 gradient shard has a pool of its own
// ([Note: the stage-1 shard between steps]).
class HostBufferPool {
 public:
  HostBufferPool();
  // Unmaps what it holds; buffers still in use are unmapped when freed.
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // As empty_buffer, with the mapping taken from the pool (uninitialised:
  // a reused mapping holds its last user's data).
  at::Tensor empty(int64_t numel, const at::TensorOptions& options);
  // Bytes of freed mappings held for reuse.
  int64_t cached_bytes() const;
  // Fresh mappings made so far (reuses not counted): each is faulted in anew.
  int64_t mappings_made() const;
  // Unmaps what it holds and returns its bytes
  // (ZeroOptimizer::release_cached_buffers).
  int64_t clear();

  struct State;  // shared with the buffers' deleters

 private:
  // Undefined where a pooled mapping does not apply (see empty_buffer).
  at::Tensor take(int64_t numel, const at::TensorOptions& options);
  std::shared_ptr<State> state_;
};

}  // namespace zeroshard
