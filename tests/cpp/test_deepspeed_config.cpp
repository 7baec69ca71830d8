#include "zeroshard/deepspeed_config.h"
#include "zeroshard/zero_options.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>
#include <type_traits>

namespace zeroshard {
namespace {

using nlohmann::json;

// The ZeRO-3 config of seeds/002 section 4.2, verbatim: it must load unchanged.
constexpr const char* kSeedConfig =
    R"({ "train_batch_size": 1024, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 16, "optimizer": { "type": "AdamW", "params": { "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01 } }, "zero_optimization": { "stage": 3, "offload_optimizer": { "device": "cpu" }, "offload_param": { "device": "cpu" }, "overlap_comm": true, "contiguous_gradients": true, "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5 } })";

// The message of the c10::ValueError that `parse` throws, or "" when it does not throw.
template <typename F>
std::string ErrorOf(F&& parse) {
  try {
    parse();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

std::string ParseError(const json& config, int64_t world_size = 1) {
  return ErrorOf([&] { parse_deepspeed_config(config, world_size); });
}

// A valid config with `patch` merged in (RFC 7386: null removes a key).
json Config(const json& patch) {
  json config = {{"train_micro_batch_size_per_gpu", 4}};
  if (patch.is_object()) {  // Config({}) passes null, which would replace everything
    config.merge_patch(patch);
  }
  return config;
}

#define EXPECT_ERROR_HAS(error, text)                                  \
  do {                                                                 \
    const std::string message_ = (error);                              \
    EXPECT_NE(message_.find(text), std::string::npos)                  \
        << "expected \"" << (text) << "\" in the error: " << message_; \
  } while (0)

// [Note: one list of the scalar options]: each option's range is stated
// once. Just below its least value, the optimizer's check raises the rule it
// states, and where a DeepSpeed key sets it the config reader refuses the
// same value under that key; at its least value both accept it.
TEST(DeepSpeedConfigTest, EveryRangedOptionIsRefusedBelowItsLeastValueByBothReaders) {
  int ranged = 0;
  const ZeroOptions defaults;
  for_each_scalar_zero_option(defaults, [&](const ZeroOptionInfo& info, const auto&) {
    if (*info.rule == '\0') {
      return;
    }
    ++ranged;
    for (const double value : {info.least - 1, info.least}) {
      ZeroOptions options;
      for_each_scalar_zero_option(options, [&](const ZeroOptionInfo& each, auto& field) {
        if (std::string(each.name) == info.name) {
          field = static_cast<std::decay_t<decltype(field)>>(value);
        }
      });
      const std::string error = ErrorOf([&] { validate_zero_options(options, 1); });
      if (value < info.least) {
        EXPECT_ERROR_HAS(error, std::string(info.name) + " must be " + info.rule + ", got ");
      } else {
        EXPECT_EQ(error, "") << info.name;
      }
      if (*info.deepspeed_key != '\0') {
        const std::string parsed = ParseError(
            Config({{"zero_optimization", {{info.deepspeed_key, static_cast<int64_t>(value)}}}}));
        if (value < info.least) {
          EXPECT_ERROR_HAS(parsed, info.deepspeed_key);
        } else {
          EXPECT_EQ(parsed, "") << info.deepspeed_key;
        }
      }
    }
  });
  EXPECT_EQ(ranged, 7);  // reduce_bucket_size ... stage3_max_live_parameters
}

TEST(DeepSpeedConfigTest, SeedZero3ConfigLoadsUnchanged) {
  const json seed = json::parse(kSeedConfig);
  const DeepSpeedConfig config = parse_deepspeed_config(seed, 8);  // 1024 = 8 * 16 * 8
  EXPECT_EQ(config.train_batch_size, 1024);
  EXPECT_EQ(config.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(config.gradient_accumulation_steps, 16);
  EXPECT_EQ(config.zero_stage, 3);
  EXPECT_EQ(config.zero.stage(), 3);
  EXPECT_TRUE(config.zero.overlap_comm());
  EXPECT_EQ(config.zero.reduce_bucket_size(), 50000000);
  EXPECT_EQ(config.zero.stage3_prefetch_bucket_size(), 50000000);
  EXPECT_EQ(config.zero.stage3_param_persistence_threshold(), 100000);
  EXPECT_EQ(config.offload_optimizer, OffloadDevice::kCPU);
  EXPECT_EQ(config.offload_param, OffloadDevice::kCPU);
  EXPECT_EQ(config.optimizer_type, "AdamW");
  EXPECT_EQ(config.optimizer_params["lr"], 1e-4);
  EXPECT_EQ(config.optimizer_params["betas"], json::array({0.9, 0.999}));
  EXPECT_EQ(config.optimizer_params["eps"], 1e-8);
  EXPECT_EQ(config.optimizer_params["weight_decay"], 0.01);
  EXPECT_FALSE(config.fp16.enabled);
  EXPECT_FALSE(config.bf16.enabled);

  // CPU offload of both kinds is supported: the sections reach ZeroOptions
  // with DeepSpeed's defaults for what they leave out.
  EXPECT_TRUE(config.unsupported.empty()) << config.unsupported.front();
  EXPECT_NO_THROW(check_supported(config));
  EXPECT_EQ(config.zero.offload_optimizer().device(), OffloadDevice::kCPU);
  EXPECT_EQ(config.zero.offload_param().device(), OffloadDevice::kCPU);
  EXPECT_DOUBLE_EQ(config.zero.offload_optimizer().ratio(), 1.0);
  // zeroshard pins by default (DeepSpeed does not): the fast choice on CUDA.
  EXPECT_TRUE(config.zero.offload_optimizer().pin_memory());
  EXPECT_EQ(config.zero.offload_param().buffer_count(), 5);
  EXPECT_EQ(config.zero.offload_param().max_in_cpu(), 1000000000);
  EXPECT_EQ(config.zero.sub_group_size(), 1000000000);

  json tuned = seed;
  tuned["zero_optimization"]["offload_optimizer"] = {
      {"device", "cpu"}, {"pin_memory", true}, {"ratio", 0.25}};
  tuned["zero_optimization"]["sub_group_size"] = 1e8;
  const DeepSpeedConfig partial = parse_deepspeed_config(tuned, 8);
  EXPECT_TRUE(partial.zero.offload_optimizer().pin_memory());
  EXPECT_DOUBLE_EQ(partial.zero.offload_optimizer().ratio(), 0.25);
  EXPECT_EQ(partial.zero.sub_group_size(), 100000000);

  // Parameter offload below stage 3 is an error naming the key (DeepSpeed: stage 3 only).
  json stage2 = seed;
  stage2["zero_optimization"]["stage"] = 2;
  EXPECT_ERROR_HAS(ErrorOf([&] { parse_deepspeed_config(stage2, 8); }),
                   "zero_optimization.offload_param.device = \"cpu\" offloads parameter "
                   "shards, which needs ZeRO stage 3");

  // The same config at another world size has an inconsistent batch triple.
  EXPECT_ERROR_HAS(ParseError(seed, 4),
                   "train_batch_size (1024) != train_micro_batch_size_per_gpu (8) * "
                   "gradient_accumulation_steps (16) * world_size (4) = 512");
}

TEST(DeepSpeedConfigTest, AnyTwoOfTheBatchTripleDetermineTheThird) {
  auto resolve = [](const json& batch, int64_t world_size) {
    const auto c = parse_deepspeed_config(batch, world_size);
    return std::make_tuple(c.train_batch_size, c.train_micro_batch_size_per_gpu,
                           c.gradient_accumulation_steps);
  };
  using T = std::tuple<int64_t, int64_t, int64_t>;
  EXPECT_EQ(resolve({{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4}}, 2),
            T(32, 4, 4));
  EXPECT_EQ(resolve({{"train_batch_size", 32}, {"gradient_accumulation_steps", 2}}, 2),
            T(32, 8, 2));
  EXPECT_EQ(resolve({{"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 2}}, 2),
            T(16, 4, 2));
  EXPECT_EQ(resolve({{"train_batch_size", 32},
                     {"train_micro_batch_size_per_gpu", 4},
                     {"gradient_accumulation_steps", 4}},
                    2),
            T(32, 4, 4));
  // One alone: no accumulation.
  EXPECT_EQ(resolve({{"train_batch_size", 32}}, 4), T(32, 8, 1));
  EXPECT_EQ(resolve({{"train_micro_batch_size_per_gpu", 3}}, 4), T(12, 3, 1));
  // Sizes written as floats, as DeepSpeed configs often do.
  EXPECT_EQ(resolve({{"train_batch_size", 64.0}, {"train_micro_batch_size_per_gpu", 8.0}}, 1),
            T(64, 8, 8));
}

TEST(DeepSpeedConfigTest, InconsistentBatchTriplePrintsAllFourNumbers) {
  EXPECT_ERROR_HAS(ParseError({{"train_batch_size", 32},
                               {"train_micro_batch_size_per_gpu", 4},
                               {"gradient_accumulation_steps", 2}},
                              2),
                   "train_batch_size (32) != train_micro_batch_size_per_gpu (4) * "
                   "gradient_accumulation_steps (2) * world_size (2) = 16");
  EXPECT_ERROR_HAS(ParseError({{"train_batch_size", 30}, {"train_micro_batch_size_per_gpu", 4}}, 2),
                   "train_batch_size (30) != train_micro_batch_size_per_gpu (4) * "
                   "gradient_accumulation_steps (unset) * world_size (2): 30 is not a multiple "
                   "of 4 * 2 = 8");
  EXPECT_ERROR_HAS(ParseError({{"train_batch_size", 30}, {"gradient_accumulation_steps", 4}}, 2),
                   "30 is not a multiple of 4 * 2 = 8");
  EXPECT_ERROR_HAS(ParseError({{"train_batch_size", 10}}, 4), "10 is not a multiple of 1 * 4 = 4");
}

TEST(DeepSpeedConfigTest, BatchSizesMustBeGivenAndPositiveIntegers) {
  EXPECT_ERROR_HAS(ParseError({{"gradient_accumulation_steps", 4}}),
                   "need train_batch_size or train_micro_batch_size_per_gpu");
  EXPECT_ERROR_HAS(ParseError(json::object()),
                   "need train_batch_size or train_micro_batch_size_per_gpu");
  EXPECT_ERROR_HAS(ParseError({{"train_batch_size", 0}}),
                   "train_batch_size must be an integer >= 1, got 0");
  EXPECT_ERROR_HAS(ParseError({{"train_micro_batch_size_per_gpu", -2}}),
                   "train_micro_batch_size_per_gpu must be an integer >= 1, got -2");
  EXPECT_ERROR_HAS(ParseError({{"train_batch_size", 1.5}}),
                   "train_batch_size must be an integer >= 1, got 1.5");
  EXPECT_ERROR_HAS(ParseError({{"train_batch_size", "32"}}),
                   "train_batch_size must be an integer >= 1, got \"32\"");
  EXPECT_ERROR_HAS(ParseError(Config({}), 0), "world_size must be >= 1, got 0");
  EXPECT_ERROR_HAS(ParseError(json::array()), "must be a JSON object");
}

TEST(DeepSpeedConfigTest, UnknownKeysNameTheirPathAndTheClosestKey) {
  EXPECT_EQ(ParseError(Config({{"zero_optimisation", {{"stage", 2}}}})),
            "unknown key \"zero_optimisation\" in the config; did you mean "
            "\"zero_optimization\"?");
  EXPECT_EQ(ParseError(Config({{"zero_optimization", {{"stag", 2}}}})),
            "unknown key \"stag\" in zero_optimization; did you mean \"stage\"?");
  EXPECT_EQ(ParseError(Config({{"zero_optimization", {{"offload_param", {{"devise", "cpu"}}}}}})),
            "unknown key \"devise\" in zero_optimization.offload_param; did you mean \"device\"?");
  EXPECT_ERROR_HAS(ParseError(Config({{"fp16", {{"loss_scale_windows", 100}}}})),
                   "in fp16; did you mean \"loss_scale_window\"?");
  EXPECT_ERROR_HAS(ParseError(Config({{"bf16", {{"Enabled", true}}}})),
                   "in bf16; did you mean \"enabled\"?");
  EXPECT_ERROR_HAS(
      ParseError(Config({{"optimizer", {{"type", "AdamW"}, {"param", json::object()}}}})),
      "in optimizer; did you mean \"params\"?");
  EXPECT_ERROR_HAS(
      ParseError(Config({{"optimizer", {{"type", "AdamW"}, {"params", {{"weight_decy", 0.1}}}}}})),
      "unknown key \"weight_decy\" in optimizer.params; did you mean \"weight_decay\"?");
  // Parameters are checked per type: momentum is SGD's, not Adam's.
  EXPECT_ERROR_HAS(
      ParseError(Config({{"optimizer", {{"type", "Adam"}, {"params", {{"momentum", 0.9}}}}}})),
      "unknown key \"momentum\" in optimizer.params");
  EXPECT_ERROR_HAS(
      ParseError(
          Config({{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_step", 10}}}}}})),
      "in scheduler.params; did you mean \"warmup_num_steps\"?");
  EXPECT_ERROR_HAS(ParseError(Config({{"zeroshard", {{"ignore_unsuported", true}}}})),
                   "in zeroshard; did you mean \"ignore_unsupported\"?");
}

TEST(DeepSpeedConfigTest, WrongTypesNameThePathAndTheExpectedType) {
  EXPECT_EQ(ParseError(Config({{"zero_optimization", {{"stage", "three"}}}})),
            "zero_optimization.stage must be an integer 0..3, got \"three\"");
  EXPECT_EQ(ParseError(Config({{"zero_optimization", {{"stage", 4}}}})),
            "zero_optimization.stage must be an integer 0..3, got 4");
  EXPECT_EQ(ParseError(Config({{"zero_optimization", {{"overlap_comm", 1}}}})),
            "zero_optimization.overlap_comm must be true or false, got 1");
  EXPECT_EQ(ParseError(Config({{"zero_optimization", {{"reduce_bucket_size", 1.5}}}})),
            "zero_optimization.reduce_bucket_size must be an integer >= 1, got 1.5");
  EXPECT_ERROR_HAS(ParseError(Config({{"zero_optimization", json::array({1})}})),
                   "zero_optimization must be an object, got [1]");
  EXPECT_ERROR_HAS(ParseError(Config({{"zero_optimization", true}})),
                   "zero_optimization must be an object");
  EXPECT_ERROR_HAS(ParseError(Config({{"gradient_clipping", -1.0}})),
                   "gradient_clipping must be a number >= 0, got -1.0");
  EXPECT_ERROR_HAS(ParseError(Config({{"steps_per_print", 0}})),
                   "steps_per_print must be an integer >= 1, got 0");
  EXPECT_ERROR_HAS(ParseError(Config({{"fp16", {{"enabled", "true"}}}})),
                   "fp16.enabled must be true or false, got \"true\"");
  EXPECT_ERROR_HAS(
      ParseError(Config({{"zero_optimization", {{"offload_optimizer", {{"device", "gpu"}}}}}})),
      "zero_optimization.offload_optimizer.device must be \"none\", \"cpu\" or "
      "\"nvme\", got \"gpu\"");
  // Hugging Face placeholders must be filled in before zeroshard sees the config.
  EXPECT_ERROR_HAS(ParseError(Config({{"train_micro_batch_size_per_gpu", "auto"}})),
                   "train_micro_batch_size_per_gpu is \"auto\"");
  EXPECT_ERROR_HAS(ParseError(Config({{"zero_optimization", {{"reduce_bucket_size", "auto"}}}})),
                   "zero_optimization.reduce_bucket_size is \"auto\": \"auto\" values are "
                   "placeholders");
  // null reads as "not set", as DeepSpeed's Optional fields do.
  json with_null = Config({});
  with_null["gradient_accumulation_steps"] = nullptr;
  EXPECT_EQ(ParseError(with_null), "");
}

TEST(DeepSpeedConfigTest, ZeroKeysMapToZeroOptions) {
  const auto config = parse_deepspeed_config(
      Config({{"zero_optimization",
               {{"stage", 2},
                {"overlap_comm", false},
                {"reduce_bucket_size", 2e6},
                {"allgather_bucket_size", 5e8},
                {"contiguous_gradients", false},
                {"round_robin_gradients", false},
                {"stage3_max_live_parameters", 1e8},
                {"max_reuse_distance", 1e9},
                {"sub_group_size", 1e9},
                {"zero_hpz_partition_size", 1},
                {"zero_quantized_weights", false},
                {"zero_quantized_gradients", false},
                {"reduce_scatter", true},
                {"allgather_partitions", true},
                {"stage3_gather_16bit_weights_on_model_save", true},
                {"offload_optimizer", {{"device", "none"}, {"pin_memory", true}}}}},
              {"gradient_clipping", 0.5}}),
      1);
  EXPECT_EQ(config.zero_stage, 2);
  EXPECT_EQ(config.zero.stage(), 2);
  EXPECT_FALSE(config.zero.overlap_comm());
  EXPECT_EQ(config.zero.reduce_bucket_size(), 2000000);
  EXPECT_EQ(config.zero.stage3_max_live_parameters(), 100000000);
  EXPECT_DOUBLE_EQ(config.zero.max_norm(), 0.5);
  EXPECT_EQ(config.offload_optimizer, OffloadDevice::kNone);
  EXPECT_TRUE(config.unsupported.empty()) << config.unsupported.front();
  EXPECT_NO_THROW(check_supported(config));

  // Keys left out keep zeroshard's defaults; DeepSpeed's defaults differ on purpose.
  const auto defaults = parse_deepspeed_config(Config({}), 1);
  EXPECT_EQ(defaults.zero_stage, 0);
  EXPECT_EQ(defaults.zero.reduce_bucket_size(), ZeroOptions().reduce_bucket_size());
  EXPECT_EQ(defaults.zero.overlap_comm(), ZeroOptions().overlap_comm());
  EXPECT_DOUBLE_EQ(defaults.gradient_clipping, 1.0);  // DeepSpeed 0.19's default
  EXPECT_DOUBLE_EQ(defaults.zero.max_norm(), 1.0);
  EXPECT_EQ(defaults.steps_per_print, 10);
  EXPECT_EQ(defaults.optimizer_type, "");
  EXPECT_EQ(defaults.scheduler.type, LrScheduleType::kNone);

  // DeepSpeed's field names are accepted as well as the stage3_ aliases, but not both at once.
  EXPECT_EQ(
      parse_deepspeed_config(Config({{"zero_optimization", {{"prefetch_bucket_size", 7}}}}), 1)
          .zero.stage3_prefetch_bucket_size(),
      7);
  EXPECT_ERROR_HAS(
      ParseError(Config({{"zero_optimization",
                          {{"prefetch_bucket_size", 7}, {"stage3_prefetch_bucket_size", 8}}}})),
      "set either zero_optimization.stage3_prefetch_bucket_size or "
      "zero_optimization.prefetch_bucket_size");
}

TEST(DeepSpeedConfigTest, HpzPartitionSizeIsTheShardGroupOfHybridSharding) {
  auto with_hpz = [](int64_t hpz, int64_t world) {
    return parse_deepspeed_config(
        Config({{"zero_optimization", {{"stage", 3}, {"zero_hpz_partition_size", hpz}}}}), world);
  };
  EXPECT_EQ(with_hpz(2, 4).shard_group_size, 2);
  EXPECT_TRUE(with_hpz(2, 4).unsupported.empty());
  EXPECT_EQ(with_hpz(0, 4).shard_group_size, 1);
  EXPECT_EQ(with_hpz(1, 4).shard_group_size, 1);
  EXPECT_EQ(
      parse_deepspeed_config(Config({{"zero_optimization", {{"stage", 2}}}}), 4).shard_group_size,
      1);
  const std::string error = ErrorOf([&] { with_hpz(3, 4); });
  EXPECT_ERROR_HAS(error,
                   "zero_optimization.zero_hpz_partition_size = 3 must divide the world "
                   "size 4");
}

TEST(DeepSpeedConfigTest, RecognisedButUnimplementedSettingsAreListed) {
  const auto config = parse_deepspeed_config(
      Config({{"zero_optimization",
               {{"stage", 3}, {"reduce_scatter", false}, {"zero_quantized_gradients", true}}},
              {"amp", {{"enabled", true}, {"opt_level", "O1"}}},
              {"tensorboard", {{"enabled", true}}}}),
      1);
  ASSERT_EQ(config.unsupported.size(), 3u);
  const std::string error = ErrorOf([&] { check_supported(config); });
  for (const char* text : {"zero_optimization.reduce_scatter = false is not supported yet",
                           "zero_optimization.zero_quantized_gradients = true is not supported yet",
                           "amp = {\"enabled\":true,\"opt_level\":\"O1\"} is not supported yet"}) {
    EXPECT_ERROR_HAS(error, text);
  }
  // Logging features cannot change what is trained: accepted silently.
  EXPECT_EQ(error.find("tensorboard"), std::string::npos) << error;
  // Switched-off features are not listed.
  EXPECT_TRUE(
      parse_deepspeed_config(Config({{"amp", {{"enabled", false}}}}), 1).unsupported.empty());
}

TEST(DeepSpeedConfigTest, OptimizerTypesAndParameters) {
  auto parse = [](const json& optimizer) {
    return parse_deepspeed_config(Config({{"optimizer", optimizer}}), 1);
  };
  const auto adamw = parse({{"type", "adamw"}, {"params", {{"lr", 3e-4}}}});
  EXPECT_EQ(adamw.optimizer_type, "AdamW");
  EXPECT_EQ(adamw.optimizer_params, json({{"lr", 3e-4},
                                          {"betas", {0.9, 0.999}},
                                          {"eps", 1e-8},
                                          {"weight_decay", 0.0},
                                          {"amsgrad", false}}));
  // DeepSpeed runs "Adam" with decoupled weight decay unless adam_w_mode is false.
  EXPECT_EQ(parse({{"type", "Adam"}}).optimizer_type, "AdamW");
  EXPECT_EQ(parse({{"type", "Adam"}, {"params", {{"adam_w_mode", false}}}}).optimizer_type, "Adam");
  EXPECT_EQ(parse({{"type", "AdamW"}, {"params", {{"adam_w_mode", false}}}}).optimizer_type,
            "AdamW");
  EXPECT_ERROR_HAS(
      ParseError(Config({{"optimizer", {{"type", "AdamW"}, {"params", {{"adam_w_mode", 1}}}}}})),
      "optimizer.params.adam_w_mode must be true or false, got 1");
  // torch_adam hands the params to torch.optim.AdamW, whose weight decay defaults to 0.01.
  EXPECT_EQ(parse({{"type", "AdamW"}, {"params", {{"torch_adam", true}}}})
                .optimizer_params["weight_decay"],
            0.01);

  const auto sgd =
      parse({{"type", "SGD"}, {"params", {{"lr", 0.1}, {"momentum", 0.9}, {"nesterov", true}}}});
  EXPECT_EQ(sgd.optimizer_type, "SGD");
  EXPECT_EQ(sgd.optimizer_params["momentum"], 0.9);
  EXPECT_EQ(sgd.optimizer_params["dampening"], 0.0);

  EXPECT_ERROR_HAS(ParseError(Config({{"optimizer", {{"type", "Lamb"}}}})),
                   "optimizer.type = \"Lamb\" is not supported yet by zeroshard; it runs "
                   "\"Adam\", \"AdamW\", \"SGD\" or \"Muon\"");
  EXPECT_ERROR_HAS(ParseError(Config({{"optimizer", {{"type", "AdamWW"}}}})),
                   "optimizer.type = \"AdamWW\" is not an optimizer DeepSpeed knows; did you mean "
                   "\"AdamW\"?");
  EXPECT_ERROR_HAS(ParseError(Config({{"optimizer", {{"params", {{"lr", 1e-3}}}}}})),
                   "optimizer.type is missing");
  EXPECT_ERROR_HAS(ParseError(Config(
                       {{"optimizer", {{"type", "AdamW"}, {"params", {{"max_grad_norm", 1.0}}}}}})),
                   "use the top-level \"gradient_clipping\"");
  EXPECT_ERROR_HAS(
      ParseError(Config({{"optimizer", {{"type", "AdamW"}, {"params", {{"betas", {0.9}}}}}}})),
      "optimizer.params.betas must be a list of two numbers in [0, 1), got [0.9]");
  EXPECT_ERROR_HAS(
      ParseError(Config({{"optimizer", {{"type", "SGD"}, {"params", {{"nesterov", true}}}}}})),
      "nesterov needs momentum > 0");
  EXPECT_ERROR_HAS(
      ParseError(Config({{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", -1}}}}}})),
      "optimizer.params.lr must be a number >= 0, got -1");
}

TEST(DeepSpeedConfigTest, MakesTheMatchingLibTorchOptions) {
  auto options_of = [](const json& optimizer) {
    return make_optimizer_options(parse_deepspeed_config(Config({{"optimizer", optimizer}}), 1));
  };
  auto adamw = options_of(
      {{"type", "AdamW"}, {"params", {{"lr", 2e-4}, {"betas", {0.8, 0.99}}, {"eps", 1e-6}}}});
  auto* a = dynamic_cast<torch::optim::AdamWOptions*>(adamw.get());
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->lr(), 2e-4);
  EXPECT_EQ(std::get<0>(a->betas()), 0.8);
  EXPECT_EQ(std::get<1>(a->betas()), 0.99);
  EXPECT_EQ(a->eps(), 1e-6);
  EXPECT_EQ(a->weight_decay(), 0.0);  // DeepSpeed's FusedAdam default, not torch's 0.01

  auto adam = options_of({{"type", "Adam"}, {"params", {{"adam_w_mode", false}}}});
  ASSERT_NE(dynamic_cast<torch::optim::AdamOptions*>(adam.get()), nullptr);

  auto sgd = options_of({{"type", "sgd"}, {"params", {{"lr", 0.5}, {"momentum", 0.9}}}});
  auto* s = dynamic_cast<torch::optim::SGDOptions*>(sgd.get());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->lr(), 0.5);
  EXPECT_EQ(s->momentum(), 0.9);

  EXPECT_ERROR_HAS(ErrorOf([] { make_optimizer_options(parse_deepspeed_config(Config({}), 1)); }),
                   "no \"optimizer\" section");
}

// [Note: DeepSpeed's Muon]: MuonWithAuxAdam's defaults, muon_lr / adam_lr over lr.
TEST(DeepSpeedConfigTest, ReadsMuonAsItsTwoHalves) {
  const DeepSpeedConfig defaults =
      parse_deepspeed_config(Config({{"optimizer", {{"type", "Muon"}}}}), 1);
  EXPECT_EQ(defaults.optimizer_type, "Muon");
  const json& p = defaults.optimizer_params;
  EXPECT_EQ(p.at("muon").at("lr"), 0.02);
  EXPECT_EQ(p.at("muon").at("momentum"), 0.95);
  EXPECT_EQ(p.at("adam").at("lr"), 3e-4);
  EXPECT_EQ(p.at("adam").at("betas"), json::array({0.9, 0.95}));
  EXPECT_EQ(p.at("adam").at("eps"), 1e-10);
  EXPECT_EQ(p.at("adam_w_mode"), true);

  const DeepSpeedConfig shared = parse_deepspeed_config(
      Config({{"optimizer",
               {{"type", "muon"},
                {"params", {{"lr", 1e-3}, {"adam_lr", 5e-4}, {"weight_decay", 0.1}}}}}}),
      1);
  EXPECT_EQ(shared.optimizer_params.at("muon").at("lr"), 1e-3);  // the shared lr
  EXPECT_EQ(shared.optimizer_params.at("adam").at("lr"), 5e-4);  // adam_lr over it
  EXPECT_EQ(shared.optimizer_params.at("adam").at("weight_decay"), 0.1);
  // One options object cannot hold two rules: the message says what to do.
  EXPECT_ERROR_HAS(ErrorOf([&] { make_optimizer_options(shared); }),
                   "in C++ call make_optimizer with model->named_parameters().pairs(), or "
                   "build the groups with deepspeed_muon_groups");
  EXPECT_ERROR_HAS(
      ParseError(Config({{"optimizer", {{"type", "Muon"}, {"params", {{"nesterov", false}}}}}})),
      "nesterov");
}

DeepSpeedConfig WithScheduler(const std::string& type, const json& params) {
  return parse_deepspeed_config(Config({{"scheduler", {{"type", type}, {"params", params}}}}), 1);
}

// Expected values were printed by DeepSpeed 0.19.8's own schedulers (lr_schedules.py) on a
// torch.optim.SGD, calling scheduler.step(step).
TEST(DeepSpeedConfigTest, WarmupLRMatchesDeepSpeed) {
  const auto log = WithScheduler(
      "WarmupLR", {{"warmup_min_lr", 0.001}, {"warmup_max_lr", 0.01}, {"warmup_num_steps", 10}});
  EXPECT_EQ(log.scheduler.type, LrScheduleType::kWarmupLR);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, -1, 0.5), 0.001);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 0, 0.5), 0.001);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 1, 0.5), 0.0037092699609758304);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 5, 0.5), 0.008003361253452792);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 9, 0.5), 0.009999999999999998);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 10, 0.5), 0.010000000000000002);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 150, 0.5), 0.010000000000000002);

  const auto linear = WithScheduler(
      "WarmupLR", {{"warmup_max_lr", 0.01}, {"warmup_num_steps", 10}, {"warmup_type", "linear"}});
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 1, 0.5), 0.001);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 5, 0.5), 0.005);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 9, 0.5), 0.009000000000000001);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 11, 0.5), 0.01);

  // Without warmup_max_lr the optimizer's lr is the peak; warmup_num_steps is at least 2.
  const auto peak = WithScheduler("WarmupLR", {{"warmup_num_steps", 10}});
  EXPECT_DOUBLE_EQ(scheduled_lr(peak, 5, 0.003), 0.0023344537511509307);
  EXPECT_DOUBLE_EQ(scheduled_lr(peak, 20, 0.003), 0.003);
  const auto one = WithScheduler("WarmupLR", {{"warmup_num_steps", 1}});
  EXPECT_DOUBLE_EQ(scheduled_lr(one, 0, 0.003), 0.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(one, 1, 0.003), 0.003);

  // No scheduler: the optimizer's lr throughout.
  EXPECT_EQ(scheduled_lr(parse_deepspeed_config(Config({}), 1), 7, 0.25), 0.25);
}

TEST(DeepSpeedConfigTest, WarmupDecayLRMatchesDeepSpeed) {
  const auto linear = WithScheduler("WarmupDecayLR", {{"total_num_steps", 100},
                                                      {"warmup_max_lr", 0.01},
                                                      {"warmup_num_steps", 10},
                                                      {"warmup_type", "linear"}});
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 5, 1.0), 0.005);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 10, 1.0), 0.01);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 11, 1.0), 0.00988888888888889);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 50, 1.0), 0.005555555555555556);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 99, 1.0), 0.00011111111111111112);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 100, 1.0), 0.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 150, 1.0), 0.0);

  // Defaults: log warm-up to 0.001 (not the optimizer's lr).
  const auto defaults =
      WithScheduler("WarmupDecayLR", {{"total_num_steps", 100}, {"warmup_num_steps", 10}});
  EXPECT_DOUBLE_EQ(scheduled_lr(defaults, 1, 1.0), 0.00030102999566398113);
  EXPECT_DOUBLE_EQ(scheduled_lr(defaults, 5, 1.0), 0.0007781512503836435);
  EXPECT_DOUBLE_EQ(scheduled_lr(defaults, 10, 1.0), 0.001);
  EXPECT_DOUBLE_EQ(scheduled_lr(defaults, 99, 1.0), 1.1111111111111112e-05);

  EXPECT_ERROR_HAS(ParseError(Config({{"scheduler", {{"type", "WarmupDecayLR"}}}})),
                   "scheduler.params.total_num_steps is required by WarmupDecayLR");
}

TEST(DeepSpeedConfigTest, WarmupCosineLRMatchesDeepSpeed) {
  const auto log = WithScheduler("WarmupCosineLR", {{"total_num_steps", 100},
                                                    {"warmup_num_steps", 10},
                                                    {"warmup_min_ratio", 0.1},
                                                    {"cos_min_ratio", 0.01}});
  EXPECT_DOUBLE_EQ(scheduled_lr(log, -1, 0.02), 0.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 0, 0.02), 0.002);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 1, 0.02), 0.007418539921951662);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 5, 0.02), 0.016006722506905584);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 10, 0.02), 0.01999396918748905);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 11, 0.02), 0.01997588409757226);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 50, 0.02), 0.011477813699504649);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 99, 0.02), 0.0002);
  EXPECT_DOUBLE_EQ(scheduled_lr(log, 150, 0.02), 0.0002);  // clamped past the end

  const auto linear = WithScheduler(
      "WarmupCosineLR",
      {{"total_num_steps", 100}, {"warmup_num_steps", 10}, {"warmup_type", "linear"}});
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 5, 0.02), 0.01);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 10, 0.02), 0.01999390887936394);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 50, 0.02), 0.011392591836499695);
  EXPECT_DOUBLE_EQ(scheduled_lr(linear, 100, 0.02), 2.0000000000000003e-06);
}

TEST(DeepSpeedConfigTest, SchedulerTypesAndParameters) {
  EXPECT_ERROR_HAS(ParseError(Config({{"scheduler", {{"type", "OneCycle"}}}})),
                   "scheduler.type = \"OneCycle\" is not supported yet by zeroshard; it runs "
                   "\"WarmupLR\", \"WarmupDecayLR\" or \"WarmupCosineLR\"");
  EXPECT_ERROR_HAS(ParseError(Config({{"scheduler", {{"type", "WarmupCosine"}}}})),
                   "did you mean \"WarmupCosineLR\"?");
  EXPECT_ERROR_HAS(
      ParseError(
          Config({{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_type", "cosine"}}}}}})),
      "scheduler.params.warmup_type must be \"log\" or \"linear\", got \"cosine\"");
  EXPECT_ERROR_HAS(
      ParseError(
          Config({{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 0}}}}}})),
      "scheduler.params.warmup_num_steps must be an integer >= 1, got 0");
  // WarmupCosineLR works in ratios of the optimizer's lr; absolute lrs are WarmupLR's.
  EXPECT_ERROR_HAS(
      ParseError(Config({{"scheduler",
                          {{"type", "WarmupCosineLR"},
                           {"params", {{"total_num_steps", 10}, {"warmup_max_lr", 0.1}}}}}})),
      "unknown key \"warmup_max_lr\" in scheduler.params");
  const auto config = WithScheduler("warmuplr", {{"warmup_max_lr", 0.1}});
  EXPECT_STREQ(lr_schedule_name(config.scheduler.type), "WarmupLR");
  EXPECT_EQ(config.scheduler_params, json({{"warmup_max_lr", 0.1}}));
}

TEST(DeepSpeedConfigTest, MixedPrecisionSections) {
  const auto fp16 = parse_deepspeed_config(Config({{"fp16",
                                                    {{"enabled", true},
                                                     {"loss_scale", 0},
                                                     {"initial_scale_power", 12},
                                                     {"loss_scale_window", 500},
                                                     {"hysteresis", 4},
                                                     {"min_loss_scale", 0.5}}}}),
                                           1);
  EXPECT_TRUE(fp16.fp16.enabled);
  EXPECT_EQ(fp16.fp16.loss_scale, 0);
  EXPECT_EQ(fp16.fp16.initial_scale_power, 12);
  EXPECT_EQ(fp16.fp16.loss_scale_window, 500);
  EXPECT_EQ(fp16.fp16.hysteresis, 4);
  EXPECT_EQ(fp16.fp16.min_loss_scale, 0.5);
  EXPECT_FALSE(fp16.bf16.enabled);

  const auto defaults = parse_deepspeed_config(Config({{"fp16", {{"enabled", true}}}}), 1).fp16;
  EXPECT_EQ(defaults.initial_scale_power, 16);
  EXPECT_EQ(defaults.loss_scale_window, 1000);
  EXPECT_EQ(defaults.hysteresis, 2);
  EXPECT_EQ(defaults.min_loss_scale, 1);

  EXPECT_TRUE(parse_deepspeed_config(Config({{"bf16", {{"enabled", true}}}}), 1).bf16.enabled);
  EXPECT_TRUE(parse_deepspeed_config(Config({{"bfloat16", {{"enabled", true}}}}), 1).bf16.enabled);
  EXPECT_ERROR_HAS(
      ParseError(Config({{"fp16", {{"enabled", true}}}, {"bf16", {{"enabled", true}}}})),
      "fp16.enabled and bf16.enabled are both true");
  EXPECT_ERROR_HAS(ParseError(Config({{"fp16", {{"loss_scale", -1}}}})),
                   "fp16.loss_scale must be a number >= 0, got -1");
  EXPECT_ERROR_HAS(ParseError(Config({{"fp16", {{"min_loss_scale", 0}}}})),
                   "fp16.min_loss_scale must be a number > 0");
}

TEST(DeepSpeedConfigTest, LoadsFilesAndNamesThePathInErrors) {
  const std::string path = testing::TempDir() + "zeroshard_ds_config_test.json";
  auto write = [&](const std::string& text) { std::ofstream(path) << text; };

  write(kSeedConfig);
  const auto seed = load_deepspeed_config(path, 8);
  EXPECT_EQ(seed.zero_stage, 3);

  write(R"({"train_batch_size": 8,})");
  std::string error = ErrorOf([&] { load_deepspeed_config(path, 1); });
  EXPECT_ERROR_HAS(error, "the DeepSpeed config \"" + path + "\" is not valid JSON: ");
  EXPECT_ERROR_HAS(error, "parse error");

  // The JSON parser would keep the last "stage"; DeepSpeed refuses duplicates.
  write(R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 3}})");
  EXPECT_ERROR_HAS(ErrorOf([&] { load_deepspeed_config(path, 1); }),
                   "has the key \"stage\" twice in one object");

  write(R"({"train_batch_size": 8, "zero_optimization": {"stage": 9}})");
  EXPECT_ERROR_HAS(ErrorOf([&] { load_deepspeed_config(path, 1); }),
                   "in the DeepSpeed config \"" + path +
                       "\": zero_optimization.stage must be an integer 0..3, got 9");
  std::remove(path.c_str());

  EXPECT_ERROR_HAS(ErrorOf([&] { load_deepspeed_config(path, 1); }),
                   "cannot read the DeepSpeed config \"" + path + "\": No such file");
}

TEST(DeepSpeedConfigTest, ZeroshardSectionAndLoggingKeys) {
  const auto config =
      parse_deepspeed_config(Config({{"zeroshard", {{"telemetry_file", "/tmp/telemetry.jsonl"}}},
                                     {"steps_per_print", 100},
                                     {"wall_clock_breakdown", true},
                                     {"flops_profiler", {{"enabled", false}}},
                                     {"zero_allow_untested_optimizer", true},
                                     {"communication_data_type", "fp32"},
                                     {"gradient_predivide_factor", 1.0}}),
                             1);
  EXPECT_EQ(config.telemetry_file, "/tmp/telemetry.jsonl");
  EXPECT_FALSE(config.ignore_unsupported);
  EXPECT_EQ(config.steps_per_print, 100);
  EXPECT_TRUE(config.wall_clock_breakdown);
  EXPECT_TRUE(config.unsupported.empty());

  const auto lossy = parse_deepspeed_config(
      Config({{"communication_data_type", "bf16"}, {"gradient_predivide_factor", 2.0}}), 1);
  EXPECT_EQ(lossy.unsupported.size(), 2u);
}

TEST(DeepSpeedConfigTest, NvmeOptimizerOffloadAndTheAioSectionAreRead) {
  const auto config = parse_deepspeed_config(Config({{"zero_optimization",
                                                      {{"stage", 2},
                                                       {"offload_optimizer",
                                                        {{"device", "nvme"},
                                                         {"nvme_path", "/local_nvme"},
                                                         {"buffer_count", 6},
                                                         {"pipeline_read", false}}}}},
                                                     {"aio",
                                                      {{"block_size", 262144},
                                                       {"queue_depth", 16},
                                                       {"thread_count", 3},
                                                       {"single_submit", true},
                                                       {"overlap_events", false}}}}),
                                             1);
  const OffloadOptions& offload = config.zero.offload_optimizer();
  EXPECT_EQ(offload.device(), OffloadDevice::kNVMe);
  EXPECT_EQ(offload.nvme_path(), "/local_nvme");
  EXPECT_EQ(offload.buffer_count(), 6);
  EXPECT_FALSE(offload.pipeline_read());
  EXPECT_TRUE(offload.pipeline_write()) << "zeroshard pipelines unless told not to";
  EXPECT_TRUE(config.unsupported.empty());
  const AioOptions& aio = config.zero.aio();
  EXPECT_EQ(aio.block_size(), 262144);
  EXPECT_EQ(aio.queue_depth(), 16);
  EXPECT_EQ(aio.intra_op_parallelism(), 3);
  EXPECT_TRUE(aio.single_submit());
  EXPECT_FALSE(aio.overlap_events());

  EXPECT_ERROR_HAS(
      ParseError(Config({{"zero_optimization", {{"offload_optimizer", {{"device", "nvme"}}}}}})),
      "zero_optimization.offload_optimizer.nvme_path is needed with device \"nvme\"");
  EXPECT_ERROR_HAS(ParseError(Config({{"aio", {{"block_size", 1000}}}})),
                   "aio.block_size must be an integer >= 4096");
  EXPECT_ERROR_HAS(ParseError(Config({{"aio", {{"queue_dept", 4}}}})), "queue_depth");
  EXPECT_FALSE(offload.swap_gradients()) << "gradient shards stay in RAM unless asked";
  const auto swapping = parse_deepspeed_config(
      Config({{"zero_optimization",
               {{"stage", 3},
                {"offload_optimizer",
                 {{"device", "nvme"}, {"nvme_path", "/local_nvme"}, {"swap_gradients", true}}}}}}),
      1);
  EXPECT_TRUE(swapping.zero.offload_optimizer().swap_gradients());
  EXPECT_ERROR_HAS(
      ParseError(
          Config({{"zero_optimization",
                   {{"offload_optimizer", {{"device", "cpu"}, {"swap_gradients", true}}}}}})),
      "zero_optimization.offload_optimizer.swap_gradients puts the gradient shard in the NVMe "
      "swap space and needs device \"nvme\"");
}

}  // namespace
}  // namespace zeroshard

namespace zeroshard {
namespace {

TEST(DeepSpeedConfigTest, AutoStageAndOffloadAreChosenFromWhatIsFree) {
  auto parse = [] {
    return parse_deepspeed_config(
        Config({{"zero_optimization",
                 {{"stage", "auto"},
                  {"offload_optimizer", {{"device", "auto"}, {"nvme_path", "/local_nvme"}}}}}}),
        8);
  };
  DeepSpeedConfig config = parse();
  EXPECT_TRUE(has_auto_settings(config));
  EXPECT_ERROR_HAS(ErrorOf([&] { check_supported(config); }),
                   "\"auto\" settings not resolved yet (zero_optimization.stage "
                   "offload_optimizer.device ): zeroshard.initialize resolves them");
  // 1e9 fp32 parameters with Adam on 8 GPUs of one node: stage 1 holds 4 + 4 + 8 / 8 bytes per
  // parameter per rank (9 GB) and 65 MB of gradient buckets (3 of 5e6 elements, 2 reduced
  // shards), stage 2 5.5 GB, stage 3 2 GB plus 240 MB of gathered units (1e7 and the 5e7 of
  // the prefetch window) and 130 MB of buckets (3 units, 2 shards).
  AvailableMemory memory;
  memory.device_bytes = 24e9;
  memory.host_bytes = 512e9;
  memory.nvme_bytes = 4e12;
  EXPECT_ERROR_HAS(resolve_auto_configuration(config, 1e9, 1e7, 8, memory),
                   "chose ZeRO stage 1: it needs 9.06 GB of 24.00 GB device memory per rank");
  EXPECT_EQ(config.zero_stage, 1);
  EXPECT_EQ(config.zero.offload_optimizer().device(), OffloadDevice::kNone);
  EXPECT_FALSE(has_auto_settings(config));
  check_supported(config);

  config = parse();
  memory.device_bytes = 3e9;
  const std::string third = resolve_auto_configuration(config, 1e9, 1e7, 8, memory);
  EXPECT_ERROR_HAS(third, "chose ZeRO stage 3: it needs 2.37 GB of 3.00 GB device memory");
  EXPECT_ERROR_HAS(third, "Rejected first: ZeRO stage 1 (needs 9.06 GB");
  EXPECT_EQ(config.zero_stage, 3);

  // Stage 3 with the optimizer state offloaded needs 0.87 GB: the parameter shard (500 MB),
  // gathered units and buckets; the gradient shard goes to the host with the state. At 1 GB
  // it is chosen, with the host's memory (CPU before NVMe); below it nothing fits, and the error
  // names the shortfall of the most offloaded candidate. The config fixes offload_param.
  config = parse();
  memory.device_bytes = 1e9;
  EXPECT_ERROR_HAS(resolve_auto_configuration(config, 1e9, 1e7, 8, memory),
                   "chose ZeRO stage 3 + optimizer offload to cpu: it needs 870.0 MB of 1.00 GB "
                   "device memory per rank");
  EXPECT_EQ(config.zero.offload_optimizer().device(), OffloadDevice::kCPU);
  config = parse();
  memory.device_bytes = 0.8e9;
  EXPECT_ERROR_HAS(ErrorOf([&] { resolve_auto_configuration(config, 1e9, 1e7, 8, memory); }),
                   "nothing fits: even ZeRO stage 3 + optimizer offload to nvme needs 870.0 MB of "
                   "800.0 MB device memory per rank");
  EXPECT_ERROR_HAS(ErrorOf([&] { resolve_auto_configuration(config, 1e9, 1e7, 8, memory); }),
                   "short of device memory by 70.0 MB per rank");

  // Without an nvme_path NVMe is not a candidate.
  config = parse_deepspeed_config(
      Config({{"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "auto"}}}}}}),
      8);
  EXPECT_ERROR_HAS(ErrorOf([&] { resolve_auto_configuration(config, 1e9, 1e7, 8, memory); }),
                   "NVMe not tried: no nvme_path given");

  // swap_gradients (NVMe optimizer offload fixed, stage "auto"): stage 1, which
  // refuses it, is no candidate, even where it would fit.
  config = parse_deepspeed_config(
      Config({{"zero_optimization",
               {{"stage", "auto"},
                {"offload_optimizer",
                 {{"device", "nvme"}, {"nvme_path", "/local_nvme"}, {"swap_gradients", true}}}}}}),
      8);
  memory.device_bytes = 24e9;
  EXPECT_ERROR_HAS(resolve_auto_configuration(config, 1e9, 1e7, 8, memory),
                   "chose ZeRO stage 2 + optimizer offload to nvme");
  EXPECT_EQ(config.zero_stage, 2);
}

}  // namespace
}  // namespace zeroshard
