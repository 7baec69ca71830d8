#include "zeroshard/loss_scaler.h"

#include <c10/util/Exception.h>

#include "zeroshard/deepspeed_config.h"

#include <algorithm>
#include <cmath>

namespace zeroshard {
namespace {

constexpr double kStateFormat = 1;
constexpr size_t kStateSize = 7;

// The config reader's range: the scale and its first doubling stay finite in
// fp32 (whose largest value is just under 2^128).
constexpr int64_t kMaxInitialScalePower = 126;

// Doubles represent every integer up to 2^53 exactly; beyond that a saved
// count could not have come from state().
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

// The integer a checkpoint number stands for; throws naming `what` if it is
// not one.
int64_t as_count(double value, const char* what) {
  TORCH_CHECK_VALUE(
      std::isfinite(value) && std::floor(value) == value && std::abs(value) <= kMaxExactInteger,
      "LossScaler::load_state: ", what, " must be an integer, got ", value);
  return static_cast<int64_t>(value);
}

}  // namespace

LossScaler::LossScaler(const LossScaleConfig& config) {
  TORCH_CHECK_VALUE(std::isfinite(config.loss_scale) && config.loss_scale >= 0,
                    "fp16.loss_scale must be a finite number >= 0 (0: dynamic loss scaling), got ",
                    config.loss_scale);
  if (!config.enabled) {
    // bf16 and fp32 train unscaled; DeepSpeed still creates a static scaler of
    // 1 for them, which is what this is.
    return;
  }
  if (config.loss_scale > 0) {
    scale_ = config.loss_scale;
    return;
  }

  // Dynamic scaling: only now are these keys used, so only now are they
  // checked (a static config may carry any values for them, as in DeepSpeed).
  TORCH_CHECK_VALUE(
      config.initial_scale_power >= 0 && config.initial_scale_power <= kMaxInitialScalePower,
      "fp16.initial_scale_power must be an integer in [0, ", kMaxInitialScalePower, "], got ",
      config.initial_scale_power);
  TORCH_CHECK_VALUE(config.loss_scale_window >= 1, "fp16.loss_scale_window must be >= 1, got ",
                    config.loss_scale_window);
  // DeepSpeed accepts 0 and then never lowers the scale: each overflow only
  // decrements the (already exhausted) tolerance.
  TORCH_CHECK_VALUE(config.hysteresis >= 1, "fp16.hysteresis must be >= 1, got ",
                    config.hysteresis);
  TORCH_CHECK_VALUE(std::isfinite(config.min_loss_scale) && config.min_loss_scale > 0,
                    "fp16.min_loss_scale must be a finite number > 0, got ", config.min_loss_scale);
  const double initial_scale = std::ldexp(1.0, static_cast<int>(config.initial_scale_power));
  // DeepSpeed accepts a minimum above the start, and then its first "decrease"
  // raises the scale to the minimum; that is surely not what was meant.
  TORCH_CHECK_VALUE(config.min_loss_scale <= initial_scale, "fp16.min_loss_scale (",
                    config.min_loss_scale,
                    ") must be <= the initial scale 2^fp16.initial_scale_power = ", initial_scale,
                    "; lower min_loss_scale or raise initial_scale_power");

  dynamic_ = true;
  scale_ = initial_scale;
  min_scale_ = config.min_loss_scale;
  window_ = config.loss_scale_window;
  hysteresis_ = config.hysteresis;
  consecutive_hysteresis_ = config.consecutive_hysteresis;
  hysteresis_left_ = hysteresis_;
}

void LossScaler::update(bool overflow) {
  if (!dynamic_) {
    overflows_ += overflow ? 1 : 0;
    ++iteration_;
    return;
  }
  // See [Note: Dynamic loss scaling] for the rule, line by line DeepSpeed's.
  if (overflow) {
    if (hysteresis_ == 1 || hysteresis_left_ == 1) {
      // Exact comparison, as DeepSpeed's: the clamp below stores min_scale_
      // itself, so reaching the minimum always compares equal.
      TORCH_CHECK(
          scale_ != min_scale_, "Current loss scale already at minimum - cannot decrease scale ",
          "anymore (DeepSpeed's wording). Step ", iteration_, " overflowed with the fp16 loss ",
          "scale already at fp16.min_loss_scale = ", min_scale_, ": the gradients keep ",
          "overflowing (inf/NaN) even at this scale, so every step would be skipped and training ",
          "cannot progress (", overflows_, " of ", iteration_,
          " steps skipped so far). Try: a lower learning rate (or a longer warmup); bf16 instead ",
          "of fp16 (fp32's range, no loss scaling); checking the data and the loss for NaN/inf ",
          "(a NaN loss overflows at any scale); or a lower fp16.min_loss_scale.");
      scale_ = std::max(scale_ / kScaleFactor, min_scale_);
    } else {
      --hysteresis_left_;
    }
    last_overflow_iteration_ = iteration_;
    ++overflows_;
  } else {
    if (consecutive_hysteresis_) {
      hysteresis_left_ = hysteresis_;
    }
    // Clean steps in a row before this one; DeepSpeed 0.19's stable_interval.
    const int64_t stable = iteration_ - last_overflow_iteration_ - 1;
    if (stable > 0 && stable % window_ == 0) {
      if (!consecutive_hysteresis_) {
        hysteresis_left_ = hysteresis_;
      }
      scale_ *= kScaleFactor;
    }
  }
  ++iteration_;
}

std::vector<double> LossScaler::state() const {
  return {kStateFormat,
          dynamic_ ? 1.0 : 0.0,
          scale_,
          static_cast<double>(iteration_),
          static_cast<double>(last_overflow_iteration_),
          static_cast<double>(hysteresis_left_),
          static_cast<double>(overflows_)};
}

void LossScaler::load_state(const std::vector<double>& state) {
  TORCH_CHECK_VALUE(state.size() == kStateSize, "LossScaler::load_state: expected the ", kStateSize,
                    " numbers of LossScaler::state(), got ", state.size());
  TORCH_CHECK_VALUE(state[0] == kStateFormat, "LossScaler::load_state: unknown format ", state[0],
                    " (this build reads format ", kStateFormat, ")");
  const bool dynamic = state[1] != 0;
  TORCH_CHECK_VALUE(dynamic == dynamic_, "LossScaler::load_state: the checkpoint was saved with ",
                    dynamic ? "dynamic" : "static", " loss scaling but the config asks for ",
                    dynamic_ ? "dynamic (fp16.loss_scale = 0)"
                             : "static scaling (fp16.loss_scale > 0, or fp16 disabled)",
                    "; use the config the checkpoint was trained with");
  const double scale = state[2];
  const int64_t iteration = as_count(state[3], "iteration");
  const int64_t last_overflow = as_count(state[4], "last overflow iteration");
  const int64_t hysteresis_left = as_count(state[5], "hysteresis left");
  const int64_t overflows = as_count(state[6], "overflows");
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0,
                    "LossScaler::load_state: scale must be finite and > 0, got ", scale);
  TORCH_CHECK_VALUE(iteration >= 0 && last_overflow >= -1 && last_overflow < iteration &&
                        overflows >= 0 && overflows <= iteration && hysteresis_left >= 1,
                    "LossScaler::load_state: inconsistent counts: iteration ", iteration,
                    ", last overflow iteration ", last_overflow, ", overflows ", overflows,
                    ", hysteresis left ", hysteresis_left);

  iteration_ = iteration;
  last_overflow_iteration_ = last_overflow;
  overflows_ = overflows;
  if (dynamic_) {
    scale_ = scale;
    // A config resumed with a smaller fp16.hysteresis cannot tolerate more
    // overflows than it allows from scratch.
    hysteresis_left_ = std::min(hysteresis_left, hysteresis_);
  }
}

}  // namespace zeroshard
