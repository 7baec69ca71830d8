#include "element_runs.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard::checkpoint_detail {

std::vector<ElementRuns> unsplit_runs(const TensorParallelSplit& split,
                                      c10::IntArrayRef local_shape, int64_t begin, int64_t numel) {
  if (numel == 0) {
    return {};
  }
  if (split.dim < 0) {
    return {{begin, numel, numel, 1}};
  }
  const auto d = static_cast<size_t>(split.dim);
  int64_t inner = 1;
  for (size_t k = d + 1; k < local_shape.size(); ++k) {
    inner *= local_shape[k];
  }
  // A local row: one index of the dimensions before `dim`, all of the ones
  // after; it sits `start` rows of `inner` into the unsplit tensor's row.
  const int64_t row = local_shape[d] * inner;
  const int64_t full_row = split.full_shape[d] * inner;
  const int64_t offset = split.start * inner;
  auto unsplit = [&](int64_t e) { return (e / row) * full_row + offset + e % row; };
  std::vector<ElementRuns> runs;
  int64_t e = begin;
  const int64_t end = begin + numel;
  if (e % row != 0) {
    const int64_t n = std::min(end, (e / row + 1) * row) - e;
    runs.push_back({unsplit(e), n, n, 1});
    e += n;
  }
  if (const int64_t rows = (end - e) / row; rows > 0) {
    runs.push_back({unsplit(e), row, full_row, rows});
    e += rows * row;
  }
  if (e < end) {
    runs.push_back({unsplit(e), end - e, end - e, 1});
  }
  return runs;
}

void for_each_shared_range(const std::vector<ElementRuns>& target, const ElementRuns& source,
                           const std::function<void(int64_t, int64_t, int64_t)>& copy) {
  if (source.numel() == 0) {
    return;
  }
  TORCH_CHECK(source.run > 0 && source.stride >= source.run, "invalid checkpoint piece: run ",
              source.run, ", stride ", source.stride);
  const int64_t source_end = source.begin + (source.count - 1) * source.stride + source.run;
  int64_t position = 0;
  for (const ElementRuns& t : target) {
    // Only the target runs that can reach the source's span.
    int64_t first = 0;
    if (source.begin - t.begin - t.run >= 0) {
      first = (source.begin - t.begin - t.run) / t.stride + 1;
    }
    const int64_t last = std::min(t.count, (source_end - t.begin + t.stride - 1) / t.stride);
    for (int64_t j = first; j < last; ++j) {
      const int64_t lo = t.begin + j * t.stride;
      const int64_t hi = lo + t.run;
      for (int64_t k = lo <= source.begin ? 0 : (lo - source.begin) / source.stride;
           k < source.count; ++k) {
        const int64_t source_lo = source.begin + k * source.stride;
        if (source_lo >= hi) {
          break;
        }
        const int64_t a = std::max(lo, source_lo);
        const int64_t b = std::min(hi, source_lo + source.run);
        if (a < b) {
          copy(position + j * t.run + (a - lo), k * source.run + (a - source_lo), b - a);
        }
      }
    }
    position += t.numel();
  }
}

}  // namespace zeroshard::checkpoint_detail
