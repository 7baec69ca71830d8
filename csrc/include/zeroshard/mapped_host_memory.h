// Host memory that goes back to the system the moment it is freed.
//
// glibc serves a large malloc with mmap only above its mmap threshold, and it
// raises that threshold (up to 32 MiB) each time such a block is freed; after
// that, freed blocks of the same size stay in the heap and in the process's
// RSS. The library's own large, short-lived host buffers (gathered stage-3
// units on a CPU device, NVMe transfer buffers, asynchronous checkpoint
// copies) therefore come from anonymous mappings of their own: page aligned
// (what O_DIRECT needs) and unmapped when the last reference goes, whatever
// the allocator's thresholds or the environment.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace zeroshard {

// A c10::Allocator over anonymous mappings (sizes rounded up to the page);
// allocate(0) gives a null pointer. Thread-safe; lives for the process.
c10::Allocator* mapped_host_allocator();

// A 1D CPU tensor of `numel` elements whose storage is such a mapping (its
// memory reads as zeros until written).
at::Tensor mapped_host_empty(int64_t numel, c10::ScalarType dtype);

}  // namespace zeroshard
