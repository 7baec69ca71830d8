#include "zeroshard/loss_scaler.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "zeroshard/deepspeed_config.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {
namespace {

// fp16 with dynamic scaling and DeepSpeed's defaults; tests change what they
// exercise.
LossScaleConfig Dynamic() {
  LossScaleConfig config;
  config.enabled = true;
  return config;
}

LossScaleConfig Dynamic(int64_t initial_scale_power, int64_t window, int64_t hysteresis,
                        bool consecutive_hysteresis = false, double min_loss_scale = 1) {
  LossScaleConfig config = Dynamic();
  config.initial_scale_power = initial_scale_power;
  config.loss_scale_window = window;
  config.hysteresis = hysteresis;
  config.consecutive_hysteresis = consecutive_hysteresis;
  config.min_loss_scale = min_loss_scale;
  return config;
}

// The message of the c10::Error (or subclass E) that `f` throws, or "" when it
// does not throw.
template <typename E = c10::Error, typename F>
std::string ErrorOf(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what_without_backtrace();
  }
  return "";
}

std::string ConfigError(const LossScaleConfig& config) {
  return ErrorOf<c10::ValueError>([&] { LossScaler scaler(config); });
}

#define EXPECT_ERROR_HAS(error, text)                                  \
  do {                                                                 \
    const std::string message_ = (error);                              \
    EXPECT_NE(message_.find(text), std::string::npos)                  \
        << "expected \"" << (text) << "\" in the error: " << message_; \
  } while (0)

// One step of a reference run: what update() was told, then the scale and the
// hysteresis left after it.
struct Step {
  bool overflow;
  double scale;
  int64_t hysteresis_left;
};

void ExpectSteps(LossScaler& scaler, const std::vector<Step>& steps) {
  for (size_t i = 0; i < steps.size(); ++i) {
    scaler.update(steps[i].overflow);
    EXPECT_EQ(scaler.scale(), steps[i].scale) << "after step " << i;
    EXPECT_EQ(scaler.hysteresis_left(), steps[i].hysteresis_left) << "after step " << i;
  }
  EXPECT_EQ(scaler.iteration(), static_cast<int64_t>(steps.size()));
}

TEST(LossScalerTest, StartsAtTwoToTheInitialScalePower) {
  LossScaler scaler(Dynamic());
  EXPECT_TRUE(scaler.dynamic());
  EXPECT_EQ(scaler.scale(), 65536.0);  // DeepSpeed's default initial_scale_power = 16
  EXPECT_EQ(scaler.iteration(), 0);
  EXPECT_EQ(scaler.overflows(), 0);
  EXPECT_EQ(scaler.hysteresis_left(), 2);

  EXPECT_EQ(LossScaler(Dynamic(0, 1000, 2)).scale(), 1.0);
  EXPECT_EQ(LossScaler(Dynamic(126, 1000, 2)).scale(), std::ldexp(1.0, 126));
}

TEST(LossScalerTest, OverflowHalvesScaleWithHysteresisOne) {
  LossScaler scaler(Dynamic(16, 1000, 1));
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 32768.0);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 16384.0);
  EXPECT_EQ(scaler.overflows(), 2);
  EXPECT_EQ(scaler.iteration(), 2);
}

TEST(LossScalerTest, HysteresisTwoToleratesOneOverflowUntilTheScaleGrows) {
  LossScaler scaler(Dynamic(16, 1000, 2));
  scaler.update(true);  // tolerated
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_EQ(scaler.hysteresis_left(), 1);
  scaler.update(true);  // halves
  EXPECT_EQ(scaler.scale(), 32768.0);
  // Without consecutive_hysteresis, clean steps do not refill the tolerance
  // (only growth does), so the next overflow halves at once.
  scaler.update(false);
  scaler.update(false);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 16384.0);
  EXPECT_EQ(scaler.hysteresis_left(), 1);
  EXPECT_EQ(scaler.overflows(), 3);
}

TEST(LossScalerTest, DoublesOnTheCleanStepAfterAFullWindow) {
  // DeepSpeed 0.19: stable = iteration - last_overflow - 1 = iteration at the
  // start, so with a window of 3 the 4th clean step doubles, then every 3rd.
  LossScaler scaler(Dynamic(4, 3, 1));
  ExpectSteps(scaler, {{false, 16, 1},
                       {false, 16, 1},
                       {false, 16, 1},
                       {false, 32, 1},
                       {false, 32, 1},
                       {false, 32, 1},
                       {false, 64, 1},
                       {false, 64, 1},
                       {false, 64, 1},
                       {false, 128, 1}});
}

TEST(LossScalerTest, OverflowRestartsTheWindow) {
  // Overflow at iteration 0: clean iterations 1..3 have stable = 0, 1, 2; the
  // 4th clean step (stable 3) doubles.
  LossScaler scaler(Dynamic(4, 3, 1));
  ExpectSteps(scaler, {{true, 8, 1},
                       {false, 8, 1},
                       {false, 8, 1},
                       {false, 8, 1},
                       {false, 16, 1},
                       {false, 16, 1},
                       {false, 16, 1},
                       {false, 32, 1},
                       {false, 32, 1}});
}

TEST(LossScalerTest, ToleratedOverflowAlsoRestartsTheWindowAndGrowthRefills) {
  // Values from DeepSpeed 0.19.8's DynamicLossScaler(init_scale=16,
  // scale_window=2, delayed_shift=3, consecutive_hysteresis=False).
  LossScaler scaler(Dynamic(4, 2, 3));
  ExpectSteps(scaler, {{true, 16, 2},
                       {false, 16, 2},
                       {false, 16, 2},  // stable 1: no growth yet
                       {true, 16, 1},   // tolerated, restarts the window
                       {false, 16, 1},
                       {false, 16, 1},
                       {false, 32, 3},  // grows and refills the tolerance
                       {false, 32, 3},
                       {true, 32, 2},
                       {true, 32, 1}});
}

TEST(LossScalerTest, ConsecutiveHysteresisRefillsOnEveryCleanStep) {
  // DeepSpeed 0.19.8, delayed_shift=2, consecutive_hysteresis=True: isolated
  // overflows never lower the scale, two in a row do.
  LossScaler scaler(Dynamic(4, 3, 2, /*consecutive_hysteresis=*/true));
  ExpectSteps(scaler, {{true, 16, 1},
                       {false, 16, 2},
                       {true, 16, 1},
                       {false, 16, 2},
                       {true, 16, 1},
                       {true, 8, 1},
                       {false, 8, 2},
                       {true, 8, 1}});
}

// A pseudo-random overflow pattern (Python's random.Random(7), 20% overflows)
// run through DeepSpeed 0.19.8's DynamicLossScaler(init_scale=2**10,
// scale_window=3, min_scale=1, delayed_shift=2).
constexpr const char* kPattern = "010100101011001000000100110010000110000000000000";

std::vector<Step> WithPattern(const std::vector<std::pair<double, int64_t>>& after) {
  std::vector<Step> steps;
  for (size_t i = 0; i < after.size(); ++i) {
    steps.push_back({kPattern[i] == '1', after[i].first, after[i].second});
  }
  return steps;
}

TEST(LossScalerTest, MatchesDeepSpeedOnAMixedSequence) {
  LossScaler scaler(Dynamic(10, 3, 2));
  ExpectSteps(scaler,
              WithPattern({{1024, 2}, {1024, 1}, {1024, 1}, {512, 1}, {512, 1}, {512, 1}, {256, 1},
                           {256, 1},  {128, 1},  {128, 1},  {64, 1},  {32, 1},  {32, 1},  {32, 1},
                           {16, 1},   {16, 1},   {16, 1},   {16, 1},  {32, 2},  {32, 2},  {32, 2},
                           {32, 1},   {32, 1},   {32, 1},   {16, 1},  {8, 1},   {8, 1},   {8, 1},
                           {4, 1},    {4, 1},    {4, 1},    {4, 1},   {8, 2},   {8, 1},   {4, 1},
                           {4, 1},    {4, 1},    {4, 1},    {8, 2},   {8, 2},   {8, 2},   {16, 2},
                           {16, 2},   {16, 2},   {32, 2},   {32, 2},  {32, 2},  {64, 2}}));
  EXPECT_EQ(scaler.overflows(), 13);
}

TEST(LossScalerTest, MatchesDeepSpeedOnAMixedSequenceWithConsecutiveHysteresis) {
  LossScaler scaler(Dynamic(10, 3, 2, /*consecutive_hysteresis=*/true));
  ExpectSteps(
      scaler,
      WithPattern({{1024, 2}, {1024, 1}, {1024, 2}, {1024, 1}, {1024, 2}, {1024, 2}, {1024, 1},
                   {1024, 2}, {1024, 1}, {1024, 2}, {1024, 1}, {512, 1},  {512, 2},  {512, 2},
                   {512, 1},  {512, 2},  {512, 2},  {512, 2},  {1024, 2}, {1024, 2}, {1024, 2},
                   {1024, 1}, {1024, 2}, {1024, 2}, {1024, 1}, {512, 1},  {512, 2},  {512, 2},
                   {512, 1},  {512, 2},  {512, 2},  {512, 2},  {1024, 2}, {1024, 1}, {512, 1},
                   {512, 2},  {512, 2},  {512, 2},  {1024, 2}, {1024, 2}, {1024, 2}, {2048, 2},
                   {2048, 2}, {2048, 2}, {4096, 2}, {4096, 2}, {4096, 2}, {8192, 2}}));
}

TEST(LossScalerTest, ClampsToTheMinimumThenRaisesAnActionableError) {
  LossScaler scaler(Dynamic(3, 1000, 1, false, /*min_loss_scale=*/3));
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 4.0);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 3.0);  // max(4 / 2, 3)

  const std::string error = ErrorOf([&] { scaler.update(true); });
  EXPECT_ERROR_HAS(error, "Current loss scale already at minimum");
  EXPECT_ERROR_HAS(error, "fp16.min_loss_scale = 3");
  EXPECT_ERROR_HAS(error, "inf/NaN");
  EXPECT_ERROR_HAS(error, "learning rate");
  EXPECT_ERROR_HAS(error, "bf16");
  EXPECT_ERROR_HAS(error, "lower fp16.min_loss_scale");
  // The failed update leaves the scaler as it was.
  EXPECT_EQ(scaler.scale(), 3.0);
  EXPECT_EQ(scaler.iteration(), 2);
  EXPECT_EQ(scaler.overflows(), 2);
}

TEST(LossScalerTest, RaisesAtTheMinimumOnlyWhenTheToleranceIsUsedUp) {
  LossScaler scaler(Dynamic(0, 1000, 2));  // starts at the minimum, 1
  scaler.update(true);                     // tolerated: no error yet
  EXPECT_EQ(scaler.scale(), 1.0);
  EXPECT_ERROR_HAS(ErrorOf([&] { scaler.update(true); }), "already at minimum");
}

TEST(LossScalerTest, StaticScaleNeverChanges) {
  LossScaleConfig config = Dynamic();
  config.loss_scale = 128;
  LossScaler scaler(config);
  EXPECT_FALSE(scaler.dynamic());
  for (bool overflow : {true, true, false, true, false, false, false}) {
    scaler.update(overflow);
    EXPECT_EQ(scaler.scale(), 128.0);
  }
  EXPECT_EQ(scaler.overflows(), 3);
  EXPECT_EQ(scaler.iteration(), 7);
}

TEST(LossScalerTest, DisabledFp16ScalesByOne) {
  LossScaleConfig config;  // enabled = false: bf16 or fp32
  config.loss_scale = 128;
  LossScaler scaler(config);
  EXPECT_FALSE(scaler.dynamic());
  EXPECT_EQ(scaler.scale(), 1.0);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 1.0);
  EXPECT_EQ(scaler.overflows(), 1);
}

TEST(LossScalerTest, StateRoundTripResumesIdentically) {
  const LossScaleConfig config = Dynamic(10, 3, 3);
  LossScaler original(config);
  for (bool overflow : {true, false, true, false, false}) {
    original.update(overflow);
  }
  LossScaler restored(config);
  restored.load_state(original.state());
  EXPECT_EQ(restored.state(), original.state());
  EXPECT_EQ(restored.hysteresis_left(), 1);  // two overflows already tolerated

  // The window position and the spent tolerance carry over: both continue
  // identically.
  for (bool overflow : {false, false, false, true, false, false, false, false, true, true}) {
    original.update(overflow);
    restored.update(overflow);
    EXPECT_EQ(restored.scale(), original.scale());
    EXPECT_EQ(restored.hysteresis_left(), original.hysteresis_left());
  }
  EXPECT_EQ(restored.state(), original.state());
  EXPECT_EQ(restored.overflows(), 5);
  EXPECT_EQ(restored.iteration(), 15);
}

TEST(LossScalerTest, StaticStateKeepsTheConfiguredScale) {
  LossScaleConfig config = Dynamic();
  config.loss_scale = 128;
  LossScaler original(config);
  original.update(true);
  original.update(false);
  config.loss_scale = 64;
  LossScaler restored(config);
  restored.load_state(original.state());
  EXPECT_EQ(restored.scale(), 64.0);
  EXPECT_EQ(restored.iteration(), 2);
  EXPECT_EQ(restored.overflows(), 1);
}

TEST(LossScalerTest, LoadStateCapsToleranceAtTheConfiguredHysteresis) {
  LossScaler original(Dynamic(10, 3, 4));
  original.update(true);  // 3 left
  LossScaler restored(Dynamic(10, 3, 2));
  restored.load_state(original.state());
  EXPECT_EQ(restored.hysteresis_left(), 2);
}

TEST(LossScalerTest, LoadStateRejectsMalformedState) {
  LossScaler dynamic(Dynamic());
  const std::vector<double> good = dynamic.state();
  auto error_of = [&](std::vector<double> state) {
    return ErrorOf<c10::ValueError>([&] { dynamic.load_state(state); });
  };
  EXPECT_EQ(error_of(good), "");
  EXPECT_ERROR_HAS(error_of({}), "expected the 7 numbers of LossScaler::state(), got 0");

  std::vector<double> bad = good;
  bad[0] = 2;
  EXPECT_ERROR_HAS(error_of(bad), "unknown format 2");

  bad = good;
  bad[1] = 0;
  EXPECT_ERROR_HAS(error_of(bad), "saved with static loss scaling but the config asks for dynamic");

  bad = good;
  bad[3] = 2.5;
  EXPECT_ERROR_HAS(error_of(bad), "iteration must be an integer, got 2.5");

  bad = good;
  bad[2] = 0;
  EXPECT_ERROR_HAS(error_of(bad), "scale must be finite and > 0");

  bad = good;
  bad[3] = 2;
  bad[4] = 2;  // the last overflow cannot be a step not yet taken
  EXPECT_ERROR_HAS(error_of(bad), "inconsistent counts");

  bad = good;
  bad[5] = 0;
  EXPECT_ERROR_HAS(error_of(bad), "inconsistent counts");

  // A rejected state leaves the scaler untouched.
  EXPECT_EQ(dynamic.state(), good);
}

TEST(LossScalerTest, RejectsInvalidConfigsNamingTheKey) {
  LossScaleConfig config = Dynamic();
  config.loss_scale = -1;
  EXPECT_ERROR_HAS(ConfigError(config), "fp16.loss_scale must be a finite number >= 0");

  config = Dynamic();
  config.loss_scale_window = 0;
  EXPECT_ERROR_HAS(ConfigError(config), "fp16.loss_scale_window must be >= 1, got 0");

  config = Dynamic();
  config.hysteresis = 0;
  EXPECT_ERROR_HAS(ConfigError(config), "fp16.hysteresis must be >= 1, got 0");

  config = Dynamic();
  config.min_loss_scale = 0;
  EXPECT_ERROR_HAS(ConfigError(config), "fp16.min_loss_scale must be a finite number > 0, got 0");

  config = Dynamic();
  config.initial_scale_power = -1;
  EXPECT_ERROR_HAS(ConfigError(config), "fp16.initial_scale_power must be an integer in [0, 126]");
  config.initial_scale_power = 127;
  EXPECT_ERROR_HAS(ConfigError(config), "got 127");

  config = Dynamic();
  config.initial_scale_power = 2;
  config.min_loss_scale = 8;
  EXPECT_ERROR_HAS(ConfigError(config), "fp16.min_loss_scale (8) must be <= the initial scale");
}

TEST(LossScalerTest, StaticConfigIgnoresDynamicOnlyKeys) {
  // As DeepSpeed: the window and minimum are unused with a static scale.
  LossScaleConfig config = Dynamic();
  config.loss_scale = 4;
  config.loss_scale_window = 0;
  config.min_loss_scale = 0;
  EXPECT_EQ(ConfigError(config), "");
}

}  // namespace
}  // namespace zeroshard
