// Stages 1-2: the all-gathers of updated parameter buckets in flight during
// a step, and how far each group's have been launched ([Note: gathers behind
// the update] in zero_optimizer_step.cpp). Internal to csrc/optimizer/.
#pragma once

#include "zeroshard/communicator.h"

#include <algorithm>
#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

namespace zeroshard {

class BucketGathers {
 public:
  explicit BucketGathers(size_t groups = 0) : launched_(groups, 0) {}

  // Launches group g's buckets [launched, end) through `start(b)`, in bucket
  // order; a bucket launched already this step is not launched again.
  void launch(size_t g, size_t end, const std::function<PendingCollective(size_t)>& start) {
    for (size_t& b = launched_[g]; b < end; ++b) {
      pending_.push_back(start(b));
    }
  }
  // Drops the gathers in flight without waiting; the next launch starts from
  // every group's first bucket.
  void forget() {
    pending_.clear();
    std::fill(launched_.begin(), launched_.end(), 0);
  }
  // Waits for every gather launched; whatever the waits do, the next step
  // starts from nothing.
  void wait_all() {
    std::vector<PendingCollective> pending = std::move(pending_);
    forget();
    for (auto& work : pending) {
      work.wait();
    }
  }

 private:
  std::vector<PendingCollective> pending_;
  std::vector<size_t> launched_;  // per group: buckets launched this step
};

}  // namespace zeroshard
