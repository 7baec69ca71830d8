// Internal to the checkpoint code: a checkpoint piece as a set of element
// runs of the unsplit tensor, so a tensor-parallel rank's piece (which is
// strided in the unsplit tensor when split along any dimension but the
// first) maps to and from any other layout. See [Note: Checkpoint pieces].
#pragma once

#include "zeroshard/tensor_parallel_split.h"

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace zeroshard::checkpoint_detail {

// `count` runs of `run` elements of a flattened tensor: run k covers
// [begin + k * stride, begin + k * stride + run). Contiguous: count 1.
struct ElementRuns {
  int64_t begin = 0;
  int64_t run = 0;
  int64_t stride = 0;
  int64_t count = 0;
  int64_t numel() const { return run * count; }
};

// Elements [begin, begin + numel) of a rank's local piece (shape
// `local_shape`, placed by `split`), as runs of the unsplit tensor's
// flattened elements in the piece's own order: at most three (a partial
// first row, whole rows, a partial last row).
std::vector<ElementRuns> unsplit_runs(const TensorParallelSplit& split,
                                      c10::IntArrayRef local_shape, int64_t begin, int64_t numel);

// Calls copy(target_position, source_position, length) for every range of
// unsplit elements `target` and `source` share; positions count elements in
// each one's own order (its runs one after the other).
void for_each_shared_range(const std::vector<ElementRuns>& target, const ElementRuns& source,
                           const std::function<void(int64_t, int64_t, int64_t)>& copy);

}  // namespace zeroshard::checkpoint_detail
