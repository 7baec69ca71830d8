// The fp16 loss scale: DeepSpeed's DynamicLossScaler and static LossScaler
// (deepspeed/runtime/fp16/loss_scaler.py), step for step.
//
// Pure bookkeeping: knows nothing of tensors or ranks. The caller multiplies
// the loss by scale(), decides whether the step overflowed (all ranks agree
// through a collective before calling update(), so every rank's scaler stays
// identical) and skips the optimizer step when it did.
//
// Thread-safety: none; one scaler per optimizer, used from its thread.
#pragma once

#include <cstdint>
#include <vector>

namespace zeroshard {

// Declared in deepspeed_config.h; not included so that users of the scaler do
// not pay for nlohmann and the LibTorch optimizer headers.
struct LossScaleConfig;

// [Note: Dynamic loss scaling]
// fp16 gradients underflow to zero when small and overflow to inf when large,
// so the loss is multiplied by a scale before backward and the gradients are
// divided by it before the optimizer step. The dynamic scaler starts high
// (2^initial_scale_power) and looks for the largest scale that does not
// overflow, exactly as DeepSpeed 0.19.8's DynamicLossScaler.update_scale:
//
//   overflow: if hysteresis == 1 or hysteresis_left == 1:
//                 error if scale == min_loss_scale (nothing lower to try);
//                 scale = max(scale / 2, min_loss_scale)
//             else: hysteresis_left -= 1     (tolerate this overflow)
//             last_overflow = iteration
//   clean:    if consecutive_hysteresis: hysteresis_left = hysteresis
//             stable = iteration - last_overflow - 1   (clean steps before this one)
//             if stable > 0 and stable % loss_scale_window == 0:
//                 if not consecutive_hysteresis: hysteresis_left = hysteresis
//                 scale *= 2
//   iteration += 1
//
// with iteration = 0, last_overflow = -1 and hysteresis_left = hysteresis at
// the start. Consequences worth knowing:
// - The scale first doubles on the (loss_scale_window + 1)-th clean step in a
//   row (after a start or an overflow), then every loss_scale_window clean
//   steps. Older DeepSpeed releases (and Megatron's original) tested
//   (iteration - last_overflow) % window == 0 instead, which doubles one step
//   earlier, on the window-th clean step; we follow the DeepSpeed that this
//   project's config reader targets (0.19).
// - A tolerated overflow also restarts the window.
// - Without consecutive_hysteresis the tolerance is refilled only when the
//   scale grows, so once it is used up every overflow halves the scale until
//   the next growth.
// - The scale can only go down to min_loss_scale; an overflow there raises
//   (DeepSpeed's raise_error_at_min_scale=True, its default and what its
//   engine uses), because skipping every step would silently stop training.
//
// Static scaling (fp16.loss_scale > 0) keeps the scale forever; fp16 turned
// off keeps 1, as DeepSpeed's CreateLossScaler does for bf16 and fp32. Either
// way update() only counts: the caller still skips an overflowed step.
class LossScaler {
 public:
  // The factor DeepSpeed multiplies and divides by (not configurable there).
  static constexpr double kScaleFactor = 2.0;

  // Throws c10::ValueError naming the fp16.* key of an invalid value. Keys
  // that only dynamic scaling uses are checked only then, as DeepSpeed does.
  explicit LossScaler(const LossScaleConfig& config);

  // What to multiply the loss by for the next backward.
  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }

  // Records one optimizer step: overflow means some rank saw inf/NaN gradients
  // and the step was skipped. Adjusts the scale per [Note: Dynamic loss
  // scaling]. Throws c10::Error, leaving the scaler unchanged, on an overflow
  // when the dynamic scale is already at min_loss_scale.
  void update(bool overflow);

  // Steps skipped because of an overflow so far.
  int64_t overflows() const { return overflows_; }
  // Steps recorded by update() so far (DeepSpeed's cur_iter).
  int64_t iteration() const { return iteration_; }
  // Overflows still tolerated before the scale halves (DeepSpeed's
  // cur_hysteresis); always 1 for static scaling.
  int64_t hysteresis_left() const { return hysteresis_left_; }

  // For checkpoints: the progress as numbers, in the order
  //   {format (1), dynamic (0/1), scale, iteration, last overflow iteration,
  //    hysteresis left, overflows}
  // Doubles hold these counts exactly up to 2^53 steps.
  std::vector<double> state() const;
  // Restores state() output. The settings (window, hysteresis, minimum...)
  // stay this scaler's own, taken from the current config; a static scale also
  // stays the config's. Throws c10::ValueError if the numbers are malformed or
  // were saved with the other kind of scaling (static vs dynamic).
  void load_state(const std::vector<double>& state);

 private:
  // Settings.
  bool dynamic_ = false;
  double min_scale_ = 1;                 // dynamic only
  int64_t window_ = 1;                   // dynamic only: loss_scale_window
  int64_t hysteresis_ = 1;               // dynamic only: DeepSpeed's delayed_shift
  bool consecutive_hysteresis_ = false;  // dynamic only

  // Progress (what state() saves).
  double scale_ = 1;
  int64_t iteration_ = 0;
  int64_t last_overflow_iteration_ = -1;
  int64_t hysteresis_left_ = 1;
  int64_t overflows_ = 0;
};

}  // namespace zeroshard
