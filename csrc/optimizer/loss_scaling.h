// The step's skip bookkeeping: the loss scale the gradients carry, a skip the
// user asked for, and what the steps did (fp16 loss scaling skips a step
// whose gradients overflowed). Internal to csrc/optimizer/.
#pragma once

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

namespace zeroshard {

class LossScaling {
 public:
  double loss_scale() const { return loss_scale_; }
  void set_loss_scale(double scale) {
    TORCH_CHECK_VALUE(scale > 0 && std::isfinite(scale), "loss scale must be finite and > 0, got ",
                      scale);
    loss_scale_ = scale;
  }
  // The next step is skipped, whatever its gradients: every rank must ask
  // alike (the flag is this rank's own; see ZeroOptimizer::skip_next_step).
  void request_skip() { skip_requested_ = true; }
  // The next step checks its gradients for inf/NaN as skip_nonfinite_steps
  // makes every step do (a caller's loss scaler: torch.amp.GradScaler).
  // Every rank must ask alike: the check is a collective's input.
  void request_overflow_check() { overflow_check_requested_ = true; }
  bool overflow_check_requested() const { return overflow_check_requested_; }
  // Records the step's outcome from whether any rank's gradients overflowed;
  // returns whether it is skipped (an overflow or a requested skip).
  bool record_step(bool overflow) {
    last_step_skipped_ = overflow || skip_requested_;
    skip_requested_ = false;
    overflow_check_requested_ = false;
    skipped_steps_ += last_step_skipped_ ? 1 : 0;
    return last_step_skipped_;
  }
  bool last_step_skipped() const { return last_step_skipped_; }
  int64_t skipped_steps() const { return skipped_steps_; }

 private:
  double loss_scale_ = 1.0;
  bool skip_requested_ = false;
  bool overflow_check_requested_ = false;
  bool last_step_skipped_ = false;
  int64_t skipped_steps_ = 0;
};

}  // namespace zeroshard
