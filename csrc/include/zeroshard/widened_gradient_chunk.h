// How much of a 16-bit gradient shard is widened to fp32 at a time, by the
// step and by the gradient norm, so that no whole-shard fp32 copy exists;
// the memory estimator counts it (memory_estimator.h, step_bytes).
#pragma once

#include <cstdint>

namespace zeroshard {

constexpr int64_t kWidenedGradientChunk = int64_t{1} << 22;  // elements: 16 MiB in fp32

}  // namespace zeroshard
