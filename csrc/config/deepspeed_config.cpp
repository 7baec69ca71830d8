#include "zeroshard/deepspeed_config.h"

#include "config_section.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>
#include <type_traits>
#include <utility>

namespace zeroshard {
namespace {

using namespace config_detail;  // NOLINT(google-build-using-namespace): this file's helpers

// ---------------------------------------------------------------------------
// clang-format off
// Known keys, one table per section. Keys of both DeepSpeed 0.19 and its
// master branch, including deprecated spellings that old configs still use.

// DeepSpeed keys that cannot change what is trained (logging, profiling,
// checkpoint I/O, data loading, features a model must call itself):
// accepted and not inspected.
const Keys kIgnoredTopLevelKeys = {
    "activation_checkpointing", "autotuning", "checkpoint", "comet", "comms_logger",
    "compile", "csv_monitor", "data_types", "dataloader_drop_last", "disable_allgather",
    "disable_python_gc", "dump_state", "flops_profiler", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "monitor_config", "pipeline",
    "seq_parallel_communication_data_type", "tensorboard", "timers",
    "use_data_before_expert_parallelism", "vocabulary_size", "wandb",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"};

// DeepSpeed features outside ZeRO. Each is unsupported when switched on: `true`, an object with
// "enabled": true, or an object without an "enabled" key that is not empty.
const Keys kFeatureTopLevelKeys = {
    "amp", "compression_training", "curriculum_learning", "data_efficiency", "eigenvalue",
    "elasticity", "expert_parallel", "graph_harvesting", "hybrid_engine", "nebula",
    "prescale_gradients", "progressive_layer_drop", "quantize_training", "sparse_attention",
    "sparse_gradients", "tensor_parallel", "torch_autocast", "weight_quantization"};

const Keys kReadTopLevelKeys = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "zero_optimization", "fp16", "bf16", "bfloat16", "gradient_clipping",
    "gradient_predivide_factor", "gradient_allreduce_op", "communication_data_type",
    "steps_per_print", "wall_clock_breakdown", "zeroshard", "aio"};

Keys top_level_keys() {
  Keys keys = kReadTopLevelKeys;
  keys.insert(keys.end(), kIgnoredTopLevelKeys.begin(), kIgnoredTopLevelKeys.end());
  keys.insert(keys.end(), kFeatureTopLevelKeys.begin(), kFeatureTopLevelKeys.end());
  return keys;
}

// zero_optimization keys that zeroshard maps or flags are read one by one below; these are
// accepted whatever their value (type-checked only): they tune DeepSpeed's own buffers and
// code paths, which zeroshard does not have.
const Keys kZeroAcceptedFlags = {
    "allgather_partitions", "compute_grad_norm", "contiguous_gradients",
    "cpu_offload_use_pin_memory", "enable_sanity_checks", "gather_16bit_weights_on_model_save",
    "ignore_unused_parameters", "load_from_fp32_weights", "log_trace_cache_warnings",
    "memory_efficient_linear", "override_module_apply", "pipeline_loading_checkpoint",
    "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage3_allgather_sequential",
    "allgather_sequential", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params", "use_multi_rank_bucket_allreduce"};
const Keys kZeroAcceptedSizes = {
    "allgather_bucket_size", "max_reuse_distance", "model_persistence_threshold",
    "module_granularity_threshold", "parameter_alignment", "partition_stream_chunk_size",
    "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_partition_stream_chunk_size"};
// Beside these, the scalar options of zero_options.h's list (zero_keys).
const Keys kZeroReadKeys = {
    "stage", "offload_optimizer", "offload_param",
    "cpu_offload", "cpu_offload_param", "reduce_scatter", "elastic_checkpoint", "legacy_stage1",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
    "mics_hierarchical_params_gather", "zenflow",
    "leaf_module"};  // a model-side option, accepted as written

Keys zero_keys() {
  Keys keys = kZeroReadKeys;
  ZeroOptions options;
  for_each_scalar_zero_option(options, [&](const ZeroOptionInfo& info, const auto&) {
    if (*info.deepspeed_key != '\0') {
      keys.emplace_back(info.deepspeed_key);
    }
    if (*info.deepspeed_alias != '\0') {
      keys.emplace_back(info.deepspeed_alias);
    }
  });
  keys.insert(keys.end(), kZeroAcceptedFlags.begin(), kZeroAcceptedFlags.end());
  keys.insert(keys.end(), kZeroAcceptedSizes.begin(), kZeroAcceptedSizes.end());
  return keys;
}

const Keys kFp16Keys = {
    "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
    "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads", "fused_mode"};
const Keys kBf16Keys = {
    "enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
    "bf16_optimizer_states"};
const Keys kZeroshardKeys = {"ignore_unsupported", "telemetry_file", "on_nonfinite",
                              "unit_classes"};

// clang-format on

// ---------------------------------------------------------------------------
// Sections.

std::string describe_triple(std::optional<int64_t> tbs, std::optional<int64_t> micro,
                            std::optional<int64_t> gas, int64_t world_size) {
  auto value = [](std::optional<int64_t> v) { return v ? std::to_string(*v) : "unset"; };
  return c10::str("train_batch_size (", value(tbs), ") != train_micro_batch_size_per_gpu (",
                  value(micro), ") * gradient_accumulation_steps (", value(gas), ") * world_size (",
                  world_size, ")");
}

int64_t checked_product(int64_t a, int64_t b, int64_t c) {
  int64_t ab = 0, abc = 0;
  TORCH_CHECK_VALUE(!__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, &abc),
                    "the batch size ", a, " * ", b, " * ", c, " overflows a 64-bit integer");
  return abc;
}

// DeepSpeed's rule: any two of the triple determine the third; one alone takes
// gradient_accumulation_steps = 1.
void read_batch(const Section& top, int64_t world_size, DeepSpeedConfig& out) {
  const auto tbs = top.optional_integer("train_batch_size", 1);
  const auto micro = top.optional_integer("train_micro_batch_size_per_gpu", 1);
  auto gas = top.optional_integer("gradient_accumulation_steps", 1);
  TORCH_CHECK_VALUE(tbs || micro,
                    gas ? "gradient_accumulation_steps alone does not determine the batch size: "
                        : "the config sets no batch size: ",
                    "need train_batch_size or train_micro_batch_size_per_gpu");
  if (micro) {
    if (tbs && !gas) {
      const int64_t per_step = checked_product(*micro, world_size, 1);
      TORCH_CHECK_VALUE(*tbs % per_step == 0, describe_triple(tbs, micro, gas, world_size), ": ",
                        *tbs, " is not a multiple of ", *micro, " * ", world_size, " = ", per_step);
      gas = *tbs / per_step;
    }
    gas = gas.value_or(1);
    const int64_t product = checked_product(*micro, *gas, world_size);
    TORCH_CHECK_VALUE(!tbs || *tbs == product, describe_triple(tbs, micro, gas, world_size), " = ",
                      product);
    out.train_micro_batch_size_per_gpu = *micro;
    out.train_batch_size = product;
  } else {
    gas = gas.value_or(1);
    const int64_t per_micro = checked_product(*gas, world_size, 1);
    TORCH_CHECK_VALUE(*tbs % per_micro == 0, describe_triple(tbs, micro, gas, world_size), ": ",
                      *tbs, " is not a multiple of ", *gas, " * ", world_size, " = ", per_micro);
    out.train_micro_batch_size_per_gpu = *tbs / per_micro;
    out.train_batch_size = *tbs;
  }
  out.gradient_accumulation_steps = *gas;
}

// The key of an aliased pair that the config uses, or `name` when it uses neither.
std::string aliased(const Section& section, const std::string& name, const std::string& alias) {
  TORCH_CHECK_VALUE(!(section.has(name) && section.has(alias)), "set either ", section.path(name),
                    " or ", section.path(alias), " (the same setting), not both");
  return section.has(alias) ? alias : name;
}

void read_zero(const Section& top, DeepSpeedConfig& out) {
  const json* raw = top.find("zero_optimization");
  TORCH_CHECK_VALUE(raw == nullptr || !raw->is_boolean(),
                    "zero_optimization must be an object such as {\"stage\": 1}, got ", *raw,
                    " (DeepSpeed's deprecated boolean form)");
  const Section zero = top.section("zero_optimization", zero_keys());

  if (zero.is_auto("stage")) {
    out.stage_auto = true;  // resolve_auto_configuration sets zero_stage
  } else {
    out.zero_stage = zero.integer("stage", 0, 0, 3);
  }
  if (out.zero_stage >= 1) {
    out.zero.stage(out.zero_stage);
  }
  // The scalar options DeepSpeed names: [Note: one list of the scalar
  // options] in zero_options.h gives their keys, older spellings and bounds.
  for_each_scalar_zero_option(out.zero, [&](const ZeroOptionInfo& info, auto& value) {
    if (*info.deepspeed_key == '\0') {
      return;  // not a zero_optimization key
    }
    using Value = std::decay_t<decltype(value)>;
    const std::string read = *info.deepspeed_alias != '\0'
                                 ? aliased(zero, info.deepspeed_key, info.deepspeed_alias)
                                 : info.deepspeed_key;
    if constexpr (std::is_same_v<Value, bool>) {
      value = zero.boolean(read, value);
    } else {
      value = static_cast<Value>(
          zero.integer(read, static_cast<int64_t>(value), static_cast<int64_t>(info.least)));
    }
  });
  for (const auto& key : kZeroAcceptedFlags) {
    zero.boolean(key, false);
  }
  for (const auto& key : kZeroAcceptedSizes) {
    zero.integer(key, 0, std::numeric_limits<int64_t>::min());
  }

  // A section without pin_memory gets zeroshard's default (pinned on CUDA).
  const bool pin = zero.boolean("cpu_offload_use_pin_memory", OffloadOptions().pin_memory());
  OffloadOptions optimizer_offload =
      read_offload(zero, "offload_optimizer", pin, out, &out.offload_optimizer);
  OffloadOptions param_offload = read_offload(zero, "offload_param", pin, out, &out.offload_param);
  // DeepSpeed's deprecated spellings of the two offloads.
  if (zero.boolean("cpu_offload", false) && out.offload_optimizer == OffloadDevice::kNone) {
    optimizer_offload.device(OffloadDevice::kCPU);
    out.offload_optimizer = OffloadDevice::kCPU;
  }
  if (zero.boolean("cpu_offload_param", false) && out.offload_param == OffloadDevice::kNone) {
    TORCH_CHECK_VALUE(out.zero_stage == 3 || out.stage_auto, zero.path("cpu_offload_param"),
                      " offloads parameter shards, which needs ZeRO stage 3");
    param_offload.device(OffloadDevice::kCPU);
    out.offload_param = OffloadDevice::kCPU;
  }
  out.zero.offload_optimizer(optimizer_offload);
  out.zero.offload_param(param_offload);

  if (!zero.boolean("reduce_scatter", true)) {
    flag(out, zero.path("reduce_scatter"), false,
         "gradients are always reduce-scattered; ignoring it changes traffic, not results");
  }
  for (const char* key : {"elastic_checkpoint", "legacy_stage1"}) {
    if (zero.boolean(key, false)) {
      flag(out, zero.path(key), true, "ignoring it keeps zeroshard's own checkpoint format");
    }
  }
  // DeepSpeed's ZeRO++ hpZ keeps a secondary copy of the parameters per group
  // of ranks; zeroshard reads the key as FSDP2's hybrid sharding, which gives
  // the same all-gathers within the group (and shards the optimizer state
  // within it too). 0 and 1 both mean no groups.
  out.shard_group_size = std::max<int64_t>(1, zero.integer("zero_hpz_partition_size", 1, 0));
  TORCH_CHECK_VALUE(out.world_size % out.shard_group_size == 0,
                    zero.path("zero_hpz_partition_size"), " = ", out.shard_group_size,
                    " must divide the world size ", out.world_size,
                    " (the ranks are split into groups of that many, each holding one sharded "
                    "copy of the state)");
  for (const char* key : {"zero_quantized_weights", "zero_quantized_nontrainable_weights",
                          "zero_quantized_gradients"}) {
    if (zero.boolean(key, false)) {
      flag(out, zero.path(key), true,
           "ZeRO++ quantized communication; ignoring it communicates at full precision, so "
           "results are more precise, not identical");
    }
  }
  const int64_t mics = zero.integer("mics_shard_size", -1, -1);
  if (mics > 0) {
    flag(out, zero.path("mics_shard_size"), mics,
         "MiCS sharding; ignoring it shards over all ranks");
  }
  if (zero.boolean("mics_hierarchical_params_gather", false)) {
    flag(out, zero.path("mics_hierarchical_params_gather"), true,
         "MiCS hierarchical gathering; ignoring it changes traffic, not results");
  }
  for (const char* key : {"zeropp_loco_param", "zenflow"}) {
    if (zero.has(key)) {
      flag(out, zero.path(key), *zero.find(key), "ignoring it trains without it");
    }
  }
}

void read_precision(const Section& top, DeepSpeedConfig& out) {
  const Section fp16 = top.section("fp16", kFp16Keys);
  LossScaleConfig& scale = out.fp16;
  scale.enabled = fp16.boolean("enabled", false);
  scale.auto_cast = fp16.boolean("auto_cast", false);
  scale.loss_scale = fp16.number("loss_scale", 0, 0);
  scale.initial_scale_power = fp16.integer("initial_scale_power", 16, 0, 126);
  scale.loss_scale_window = fp16.integer("loss_scale_window", 1000, 1);
  scale.hysteresis = fp16.integer("hysteresis", 2, 1);
  scale.consecutive_hysteresis = fp16.boolean("consecutive_hysteresis", false);
  scale.min_loss_scale = fp16.number("min_loss_scale", 1, 0);
  TORCH_CHECK_VALUE(scale.min_loss_scale > 0, fp16.path("min_loss_scale"),
                    " must be a number > 0, got 0");
  fp16.boolean("fused_mode", true);
  if (fp16.boolean("fp16_master_weights_and_grads", false)) {
    flag(out, fp16.path("fp16_master_weights_and_grads"), true,
         "master weights stay in fp32; results are more precise, not identical");
  }

  TORCH_CHECK_VALUE(!(top.has("bf16") && top.has("bfloat16")),
                    "set either bf16 or bfloat16 (its old name), not both");
  const std::string bf16_key = top.has("bfloat16") ? "bfloat16" : "bf16";
  const Section bf16 = top.section(bf16_key, kBf16Keys);
  out.bf16.enabled = bf16.boolean("enabled", false);
  out.bf16.immediate_grad_update = bf16.boolean("immediate_grad_update", false);
  out.bf16.check_grad_overflow = bf16.boolean("check_grad_overflow", false);
  for (const char* key : {"bf16_master_weights_and_grads", "bf16_optimizer_states"}) {
    if (bf16.boolean(key, false)) {
      flag(out, bf16.path(key), true,
           "master weights and optimizer states stay in fp32; results are more precise, not "
           "identical");
    }
  }
  TORCH_CHECK_VALUE(!(out.fp16.enabled && out.bf16.enabled), "fp16.enabled and ", bf16_key,
                    ".enabled are both true; enable at most one");
}

void read_top_level_features(const Section& top, DeepSpeedConfig& out) {
  for (const auto& key : kFeatureTopLevelKeys) {
    const json* value = top.find(key);
    if (value == nullptr) {
      continue;
    }
    bool enabled = false;
    if (value->is_boolean()) {
      enabled = value->get<bool>();
    } else if (value->is_object()) {
      const auto it = value->find("enabled");
      enabled = it == value->end() ? !value->empty() : (it->is_boolean() && it->get<bool>());
    } else {
      enabled = true;
    }
    if (enabled) {
      flag(out, key, *value, "ignoring it trains without it");
    }
  }

  const double predivide = top.number("gradient_predivide_factor", 1, 0);
  if (predivide != 1) {
    flag(out, "gradient_predivide_factor", *top.find("gradient_predivide_factor"),
         "gradients are divided by the world size after the reduction; ignoring it changes "
         "rounding only");
  }
  if (top.choice("gradient_allreduce_op", "mean", {"mean", "sum"}) == "sum") {
    flag(out, "gradient_allreduce_op", "sum",
         "gradients are averaged over ranks; ignoring it makes them world_size times smaller");
  }
  if (top.has("communication_data_type")) {
    const std::string dtype =
        top.choice("communication_data_type", "fp32", {"fp32", "fp16", "bf16"});
    const std::string params = out.fp16.enabled ? "fp16" : out.bf16.enabled ? "bf16" : "fp32";
    if (dtype == "fp32" && params != "fp32") {
      out.zero.reduce_in_fp32(true);  // 16-bit model, gradients reduced in fp32
    } else if (dtype != params) {
      flag(out, "communication_data_type", dtype,
           "gradients are reduced in the parameters' dtype or in fp32");
    }
  }
}

}  // namespace

DeepSpeedConfig parse_deepspeed_config(const nlohmann::json& config, int64_t world_size) {
  TORCH_CHECK_VALUE(world_size >= 1, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK_VALUE(config.is_object(), "a DeepSpeed config must be a JSON object, got ",
                    config.type_name());
  const Section top(&config, "", top_level_keys());
  DeepSpeedConfig out;
  out.world_size = world_size;
  read_batch(top, world_size, out);
  read_zero(top, out);
  read_precision(top, out);
  read_optimizer(top, out);
  read_scheduler(top, out);
  read_top_level_features(top, out);

  // DeepSpeed 0.19 clips at 1.0 unless told otherwise; older releases did not clip.
  out.gradient_clipping = top.number("gradient_clipping", 1.0, 0);
  out.zero.max_norm(out.gradient_clipping);
  out.steps_per_print = top.integer("steps_per_print", 10, 1);
  out.wall_clock_breakdown = top.boolean("wall_clock_breakdown", false);

  read_aio(top, out);

  const Section zeroshard = top.section("zeroshard", kZeroshardKeys);
  out.ignore_unsupported = zeroshard.boolean("ignore_unsupported", false);
  out.telemetry_file = zeroshard.string("telemetry_file", "");
  if (const json* classes = zeroshard.find("unit_classes")) {
    const bool is_list =
        classes->is_array() && std::all_of(classes->begin(), classes->end(),
                                           [](const json& item) { return item.is_string(); });
    TORCH_CHECK_VALUE(is_list, zeroshard.path("unit_classes"),
                      " must be a list of module class names such as [\"LlamaDecoderLayer\"], "
                      "got ",
                      *classes);
    out.unit_classes = classes->get<std::vector<std::string>>();
  }
  out.raise_on_nonfinite = zeroshard.choice("on_nonfinite", "skip", {"skip", "raise"}) == "raise";
  TORCH_CHECK_VALUE(!out.raise_on_nonfinite || (out.bf16.enabled && out.bf16.check_grad_overflow),
                    "zeroshard.on_nonfinite applies to bf16 with bf16.check_grad_overflow = true "
                    "(fp16 always skips and lowers the loss scale)");
  return out;
}

DeepSpeedConfig load_deepspeed_config(const std::string& path, int64_t world_size) {
  std::ifstream file(path);
  TORCH_CHECK_VALUE(file.is_open(), "cannot read the DeepSpeed config \"", path,
                    "\": ", std::strerror(errno));
  std::stringstream text;
  text << file.rdbuf();

  // nlohmann keeps the last of duplicate keys; DeepSpeed's loader rejects them, and a silently
  // dropped "stage" would train something else.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  const json::parser_callback_t reject_duplicates = [&](int /*depth*/, json::parse_event_t event,
                                                        json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == json::parse_event_t::key && !open_objects.empty() &&
               !open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json config;
  try {
    config = json::parse(text.str(), reject_duplicates);
  } catch (const json::parse_error& e) {
    TORCH_CHECK_VALUE(false, "the DeepSpeed config \"", path, "\" is not valid JSON: ", e.what());
  }
  TORCH_CHECK_VALUE(duplicate.empty(), "the DeepSpeed config \"", path, "\" has the key \"",
                    duplicate, "\" twice in one object");
  try {
    return parse_deepspeed_config(config, world_size);
  } catch (const c10::ValueError& e) {
    C10_THROW_ERROR(ValueError, c10::str("in the DeepSpeed config \"", path,
                                         "\": ", e.what_without_backtrace()));
  }
}

void check_supported(const DeepSpeedConfig& config) {
  TORCH_CHECK_VALUE(!has_auto_settings(config),
                    "the DeepSpeed config has \"auto\" settings not resolved yet (",
                    config.stage_auto ? "zero_optimization.stage " : "",
                    config.offload_optimizer_auto ? "offload_optimizer.device " : "",
                    config.offload_param_auto ? "offload_param.device" : "",
                    "): zeroshard.initialize resolves them from the memory free on each rank; "
                    "from C++ call resolve_auto_configuration first");
  if (config.unsupported.empty() || config.ignore_unsupported) {
    return;
  }
  std::string list;
  for (const auto& line : config.unsupported) {
    list += "\n  " + line;
  }
  TORCH_CHECK_VALUE(false,
                    "the DeepSpeed config asks for settings zeroshard does not support yet:", list,
                    "\nRemove them, or add \"zeroshard\": {\"ignore_unsupported\": true} to the "
                    "config to train as if they were absent.");
}

}  // namespace zeroshard
