// DeepSpeed's LR schedules: reading the "scheduler" section and the
// learning rate each step runs with (scheduled_lr).
#include "config_section.h"

#include <cmath>

namespace zeroshard {
namespace {
constexpr double kPi = 3.14159265358979323846;  // Python's math.pi
}  // namespace

namespace config_detail {
namespace {

// clang-format off
const Keys kSchedulerKeys = {"type", "params"};
const Keys kWarmupLrParams = {
    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"};
const Keys kWarmupDecayLrParams = {
    "total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
    "last_batch_iteration"};
const Keys kWarmupCosineLrParams = {
    "total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
    "last_batch_iteration"};

const Keys kSupportedSchedulers = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"};
const Keys kOtherSchedulers = {
    "LRRangeTest", "OneCycle", "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR",
    "ConstantLR", "LinearLR", "ExponentialLR", "PolynomialLR", "CosineAnnealingLR",
    "ChainedScheduler", "SequentialLR", "ReduceLROnPlateau", "CyclicLR", "OneCycleLR",
    "CosineAnnealingWarmRestarts"};
// clang-format on

}  // namespace

void read_scheduler(const Section& top, DeepSpeedConfig& out) {
  if (!top.has("scheduler")) {
    return;
  }
  const Section scheduler = top.section("scheduler", kSchedulerKeys);
  TORCH_CHECK_VALUE(scheduler.has("type"), "scheduler.type is missing; expected ",
                    quoted_list(kSupportedSchedulers));
  const std::string written = scheduler.string("type", "");
  const std::string type = find_name(written, kSupportedSchedulers);
  if (type.empty()) {
    TORCH_CHECK_VALUE(find_name(written, kOtherSchedulers).empty(), "scheduler.type = \"", written,
                      "\" is not supported yet by zeroshard; it runs ",
                      quoted_list(kSupportedSchedulers));
    Keys all = kSupportedSchedulers;
    all.insert(all.end(), kOtherSchedulers.begin(), kOtherSchedulers.end());
    TORCH_CHECK_VALUE(false, "scheduler.type = \"", written,
                      "\" is not a scheduler DeepSpeed knows; did you mean \"",
                      closest(written, all), "\"?");
  }

  LrScheduleConfig& s = out.scheduler;
  s.type = type == "WarmupLR"        ? LrScheduleType::kWarmupLR
           : type == "WarmupDecayLR" ? LrScheduleType::kWarmupDecayLR
                                     : LrScheduleType::kWarmupCosineLR;
  const Keys& known = s.type == LrScheduleType::kWarmupLR        ? kWarmupLrParams
                      : s.type == LrScheduleType::kWarmupDecayLR ? kWarmupDecayLrParams
                                                                 : kWarmupCosineLrParams;
  const Section params = scheduler.section("params", known);
  if (const json* written_params = scheduler.find("params")) {
    out.scheduler_params = *written_params;
  }
  const auto last =
      params.optional_integer("last_batch_iteration", std::numeric_limits<int64_t>::min());
  TORCH_CHECK_VALUE(!last || *last == -1, params.path("last_batch_iteration"),
                    " must be -1 (a fresh start), got ", *last,
                    "; a resumed run restores the iteration from its checkpoint");
  s.warmup_type = params.choice("warmup_type", "log", {"log", "linear"}) == "log"
                      ? WarmupType::kLog
                      : WarmupType::kLinear;
  s.warmup_num_steps = params.integer("warmup_num_steps", 1000, 1);
  if (s.type != LrScheduleType::kWarmupLR) {
    TORCH_CHECK_VALUE(params.has("total_num_steps"), params.path("total_num_steps"),
                      " is required by ", type);
    s.total_num_steps = params.integer("total_num_steps", 0, 1);
  }
  if (s.type == LrScheduleType::kWarmupCosineLR) {
    s.warmup_min_ratio = params.number("warmup_min_ratio", 0, 0);
    s.cos_min_ratio = params.number("cos_min_ratio", 0.0001, 0);
    return;
  }
  s.warmup_min_lr = params.number("warmup_min_lr", 0, 0);
  s.warmup_max_lr = params.optional_number("warmup_max_lr", 0);
  if (s.type == LrScheduleType::kWarmupDecayLR && !s.warmup_max_lr) {
    s.warmup_max_lr = 0.001;
  }
}

}  // namespace config_detail

const char* lr_schedule_name(LrScheduleType type) {
  switch (type) {
    case LrScheduleType::kNone:
      return "none";
    case LrScheduleType::kWarmupLR:
      return "WarmupLR";
    case LrScheduleType::kWarmupDecayLR:
      return "WarmupDecayLR";
    case LrScheduleType::kWarmupCosineLR:
      return "WarmupCosineLR";
  }
  return "unknown";
}

// Transcribed from WarmupLR, WarmupDecayLR and WarmupCosineLR in DeepSpeed's
// deepspeed/runtime/lr_schedules.py (0.19), operation for operation so that the values match
// to the last bit where the arithmetic allows.
double scheduled_lr(const DeepSpeedConfig& config, int64_t step, double base_lr) {
  const LrScheduleConfig& s = config.scheduler;
  if (s.type == LrScheduleType::kNone) {
    return base_lr;
  }
  const int64_t warmup = std::max<int64_t>(2, s.warmup_num_steps);
  const double inverse_log_warmup = 1.0 / std::log(static_cast<double>(warmup));
  // The warm-up fraction: 0 at step 0, approaching 1 at step `warmup`.
  auto warmup_gamma = [&] {
    return s.warmup_type == WarmupType::kLog
               ? inverse_log_warmup * std::log(static_cast<double>(step + 1))
               : static_cast<double>(step) / static_cast<double>(warmup);
  };

  if (s.type == LrScheduleType::kWarmupCosineLR) {
    if (step < 0) {
      return 0.0;  // DeepSpeed's value before the first step()
    }
    double ratio = 0;
    if (step < warmup) {
      ratio = s.warmup_min_ratio + warmup_gamma() * (1.0 - s.warmup_min_ratio);
    } else {
      const double real_last_step = static_cast<double>(step - warmup + 1);
      const double real_total_steps =
          static_cast<double>(std::max<int64_t>(1, s.total_num_steps - warmup));
      // Clamped (DeepSpeed 0.19): past total_num_steps the ratio stays at cos_min_ratio.
      const double progress = std::min(1.0, real_last_step / real_total_steps);
      ratio = (1 + std::cos(kPi * progress)) / 2;
      ratio = std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * ratio);
    }
    return base_lr * ratio;
  }

  const double min_lr = s.warmup_min_lr;
  const double delta_lr = s.warmup_max_lr.value_or(base_lr) - min_lr;
  if (step < 0) {
    return min_lr;
  }
  double gamma = 1.0;
  if (step < warmup) {
    gamma = warmup_gamma();
  } else if (s.type == LrScheduleType::kWarmupDecayLR) {
    gamma = std::max(0.0, static_cast<double>(s.total_num_steps - step) /
                              std::max(1.0, static_cast<double>(s.total_num_steps - warmup)));
  }
  return min_lr + delta_lr * gamma;
}

}  // namespace zeroshard
