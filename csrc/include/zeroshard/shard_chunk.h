// How many elements of a shard are processed at a time wherever a temporary
// the size of the whole shard must not exist: a 16-bit gradient shard
// widened to fp32 by the step and the gradient norm, a host shard crossing
// the device for the replica all-reduce, parameters refreshed from an
// offloaded master. The memory estimator counts one such chunk
// (memory_estimator.h, step_bytes).
#pragma once

#include <cstdint>

namespace zeroshard {

constexpr int64_t kShardChunkElements = int64_t{1} << 22;  // elements: 16 MiB in fp32

}  // namespace zeroshard
