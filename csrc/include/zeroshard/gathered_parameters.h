// RAII: the chosen parameters hold their full values while the guard lives
// (stage 3 gathers their units; stages 1 and 2 always hold them), as
// DeepSpeed's GatheredParameters and the Python
// `ZeroOptimizer.gathered_parameters()` context manager:
//
//   {
//     zeroshard::GatheredParameters full(optimizer, {model->weight}, /*modifier_rank=*/0);
//     if (rank == 0) model->weight.fill_(0.5);  // under torch::NoGradGuard
//   }  // rank 0's values are broadcast and kept in every rank's shard
//
// Collective: every rank constructs and destroys it at the same point.
#pragma once

#include "zeroshard/zero_optimizer.h"

#include <c10/util/Logging.h>

#include <utility>
#include <vector>

namespace zeroshard {

class GatheredParameters {
 public:
  // params empty: every parameter. modifier_rank >= 0: that rank's edits are
  // broadcast and stored when the guard ends.
  GatheredParameters(ZeroOptimizer& optimizer, std::vector<at::Tensor> params = {},
                     int64_t modifier_rank = -1)
      : optimizer_(&optimizer), params_(std::move(params)), modifier_rank_(modifier_rank) {
    optimizer_->pin_parameters(params_);
  }
  GatheredParameters(const GatheredParameters&) = delete;
  GatheredParameters& operator=(const GatheredParameters&) = delete;

  // Ends the guard now; errors (e.g. a failed broadcast) are thrown here.
  void release() {
    if (optimizer_ != nullptr) {
      ZeroOptimizer* optimizer = std::exchange(optimizer_, nullptr);
      optimizer->unpin_parameters(params_, modifier_rank_);
    }
  }

  // A destructor cannot throw: call release() to see errors.
  ~GatheredParameters() {
    try {
      release();
    } catch (const std::exception& e) {
      LOG(ERROR) << "zeroshard::GatheredParameters: releasing failed: " << e.what();
    }
  }

 private:
  ZeroOptimizer* optimizer_;
  std::vector<at::Tensor> params_;
  int64_t modifier_rank_;
};

}  // namespace zeroshard
