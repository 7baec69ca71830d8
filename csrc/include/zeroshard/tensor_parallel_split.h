// Where a rank's local piece of a tensor-parallel parameter sits in the
// unsplit tensor (PyTorch TP's Shard(dim) and Replicate placements on a 1-D
// mesh). Checkpoints store every state in the unsplit tensor's element
// order, so they load at any tensor-parallel degree, or without TP.
#pragma once

#include <cstdint>
#include <vector>

namespace zeroshard {

struct TensorParallelSplit {
  // The dimension the tensor is split along; -1: this rank holds all of it
  // (a copy equal on every tensor-parallel rank).
  int64_t dim = -1;
  // The first index along `dim` this rank holds.
  int64_t start = 0;
  // The unsplit tensor's shape.
  std::vector<int64_t> full_shape;
};

}  // namespace zeroshard
