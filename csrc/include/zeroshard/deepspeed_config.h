// DeepSpeed's JSON configuration (ds_config.json) read into zeroshard's
// options, so that a DeepSpeed training script's config runs unchanged.
//
// Reading is stricter than DeepSpeed where DeepSpeed would silently do
// something else: unknown keys (with the closest valid key), values of the
// wrong type, sizes that are not integers and Hugging Face "auto"
// placeholders are errors naming the key's path. Settings that DeepSpeed has
// and zeroshard does not implement yet are not errors at parse time; see
// [Note: Unsupported settings].
//
// Pure configuration: knows nothing of tensors, ranks or process groups.
#pragma once

#include <torch/csrc/api/include/torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include "zeroshard/memory_estimator.h"
#include "zeroshard/zero_options.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard {

// [Note: Unsupported settings]
// A config written for DeepSpeed may ask for features zeroshard does not
// have yet (NVMe offload, quantized or hierarchical collectives, apex
// AMP...). parse_deepspeed_config() accepts them, records their values and
// lists each in DeepSpeedConfig::unsupported, so that a config can always be
// read, inspected and estimated (memory_estimator.h) before any training.
// check_supported(), for the training entry point to call before it starts,
// then refuses them unless the config opts in with
//   "zeroshard": {"ignore_unsupported": true}
// in which case the caller warns and trains as if they were absent. Offload
// only moves where state lives, so ignoring it changes memory use, not the
// results; the listed message says what ignoring each setting means.
// Optimizer and scheduler types zeroshard lacks (Lamb, OneCycle...) are
// errors at parse time instead: there is nothing to train with in their
// place.

// fp16 mixed precision with loss scaling: DeepSpeed's "fp16" keys and
// defaults.
struct LossScaleConfig {
  bool enabled = false;
  double loss_scale = 0;                // > 0: static scale; 0: dynamic scaling
  int64_t initial_scale_power = 16;     // the dynamic scale starts at 2^power
  int64_t loss_scale_window = 1000;     // steps without overflow before the scale doubles
  int64_t hysteresis = 2;               // overflows tolerated before the scale halves
  bool consecutive_hysteresis = false;  // refill the hysteresis after a step without overflow
  double min_loss_scale = 1;
  bool auto_cast = false;  // cast the model's inputs to fp16
};

// bf16 mixed precision: no loss scaling.
struct Bf16Config {
  bool enabled = false;
  bool immediate_grad_update = false;
  bool check_grad_overflow = false;
};

enum class LrScheduleType { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
enum class WarmupType { kLog, kLinear };

// "scheduler" with DeepSpeed's defaults filled in; read by scheduled_lr().
struct LrScheduleConfig {
  LrScheduleType type = LrScheduleType::kNone;
  WarmupType warmup_type = WarmupType::kLog;
  // As written (>= 1); the formulas use max(2, warmup_num_steps), as DeepSpeed does, so that
  // log(warmup_num_steps) is never 0.
  int64_t warmup_num_steps = 1000;
  int64_t total_num_steps = 0;  // WarmupDecayLR and WarmupCosineLR (required there)
  // WarmupLR and WarmupDecayLR, absolute learning rates. WarmupLR's unset warmup_max_lr is the
  // optimizer's lr (recent DeepSpeed; older releases used 0.001); WarmupDecayLR's is 0.001.
  double warmup_min_lr = 0;
  std::optional<double> warmup_max_lr;
  // WarmupCosineLR, fractions of the optimizer's lr.
  double warmup_min_ratio = 0;
  double cos_min_ratio = 0.0001;
};

struct DeepSpeedConfig {
  // The batch triple, resolved: train_batch_size = train_micro_batch_size_per_gpu *
  // gradient_accumulation_steps * world_size.
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  int64_t world_size = 0;  // the one the triple was resolved for

  // 0 is plain data parallelism (no sharding); `zero` then keeps its default stage and is not
  // used. ZeroOptions accepts stages 1..3 only.
  int64_t zero_stage = 0;
  // stage, overlap_comm, reduce_bucket_size, the stage3_* sizes, and max_norm (from
  // gradient_clipping). Keys the config leaves out keep zeroshard's defaults, which differ from
  // DeepSpeed's for reduce_bucket_size (5e6, not 5e8) and overlap_comm (on at every stage, not
  // only stage 3): see zero_options.h for why.
  ZeroOptions zero;
  // zero_optimization.zero_hpz_partition_size, read as hybrid sharding: the
  // state is sharded over groups of this many consecutive ranks and
  // replicated across the groups (see ZeroOptimizer's hybrid constructor;
  // make_hybrid_gloo_groups builds the groups). 1: shard over all ranks.
  int64_t shard_group_size = 1;
  // The offload devices as written (CPU offload is in zero.offload_optimizer()
  // and zero.offload_param(); NVMe is listed in `unsupported`).
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;

  // "Adam", "AdamW", "SGD" or "Muon": what DeepSpeed would run. DeepSpeed runs "Adam" as AdamW
  // unless its params say "adam_w_mode": false, so "Adam" here means coupled weight decay. Empty
  // when the config has no "optimizer" (the caller brings its own, as in DeepSpeed).
  std::string optimizer_type;
  // The optimizer's hyper-parameters with DeepSpeed's defaults filled in:
  //   Adam/AdamW: lr, betas [b1, b2], eps, weight_decay, amsgrad;
  //   SGD: lr, momentum, dampening, weight_decay, nesterov;
  //   Muon: muon {lr, momentum, weight_decay}, adam {lr, betas, eps, weight_decay},
  //   adam_w_mode, and lr / weight_decay as the Muon half's ([Note: DeepSpeed's Muon]).
  // DeepSpeed's selectors (torch_adam, adam_w_mode, ...) are resolved and dropped.
  nlohmann::json optimizer_params = nlohmann::json::object();

  LrScheduleConfig scheduler;
  nlohmann::json scheduler_params = nlohmann::json::object();  // as written, for logs

  // Global-norm clipping, also set as zero.max_norm; 0 is off. 1.0 is DeepSpeed 0.19's default
  // (older releases did not clip by default).
  double gradient_clipping = 1.0;
  LossScaleConfig fp16;
  Bf16Config bf16;
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;

  // The "zeroshard" section: keys DeepSpeed does not know.
  bool ignore_unsupported = false;  // see [Note: Unsupported settings]
  std::string telemetry_file;       // empty: none
  // bf16 with check_grad_overflow: "zeroshard": {"on_nonfinite": "raise"} makes a
  // step with inf/NaN gradients an error on every rank instead of a skip.
  bool raise_on_nonfinite = false;
  // Stage 3 wrap policy by class name ("zeroshard": {"unit_classes": ["Block"]}), resolved
  // against the model's module classes by the Python engine; C++ models mark their units with
  // make_unit (unit_module.h). Empty: the default policy.
  std::vector<std::string> unit_classes;

  // "auto" as zero_optimization.stage, offload_optimizer.device or offload_param.device:
  // chosen by resolve_auto_configuration before training (check_supported refuses a config
  // that still holds one). The offload sections' other keys (nvme_path, buffer_count, ...)
  // are read as usual and apply to whatever device is chosen.
  bool stage_auto = false;
  bool offload_optimizer_auto = false;
  bool offload_param_auto = false;

  // One line per setting zeroshard does not implement yet, e.g.
  //   zero_optimization.offload_optimizer.device = "nvme" is not supported yet by zeroshard (...)
  std::vector<std::string> unsupported;
};

// Reads a parsed DeepSpeed config for `world_size` data-parallel ranks. Throws c10::ValueError
// naming the key's path for unknown keys, wrong types, out-of-range values and an inconsistent
// batch triple; never for unsupported settings (see [Note: Unsupported settings]).
DeepSpeedConfig parse_deepspeed_config(const nlohmann::json& config, int64_t world_size);

// Reads the file at `path` (strict JSON, duplicate keys rejected as DeepSpeed does) and parses
// it. Errors name the path, and for invalid JSON include the parser's message.
DeepSpeedConfig load_deepspeed_config(const std::string& path, int64_t world_size);

// Throws c10::ValueError listing config.unsupported, unless the list is empty or the config
// sets "zeroshard": {"ignore_unsupported": true}; and for an "auto" setting not resolved yet.
void check_supported(const DeepSpeedConfig& config);

// Whether the config says "auto" for the stage or an offload device.
bool has_auto_settings(const DeepSpeedConfig& config);
// Resolves the "auto" settings with choose_configuration (memory_estimator.h) for a model of
// `num_params` parameters whose largest stage-3 unit has `largest_unit_params`, trained with
// `ranks_per_node` ranks per node and the memory `available` (the minimum over ranks, so that
// every rank decides alike; NVMe is tried only where the offload section gives an nvme_path).
// Precision, optimizer, sub_group_size and the offload sections' keys come from the config.
// Returns the decision and the figures behind it; throws c10::ValueError with those figures,
// naming what is short, when nothing fits.
// `needs_stage3`: the model can only train at stage 3 (built on the meta device, or stage-3
// settings such as unit_classes given). NVMe parameter offload is tried only where the largest
// unit's shard fits offload_param.buffer_size.
std::string resolve_auto_configuration(DeepSpeedConfig& config, double num_params,
                                       double largest_unit_params, int64_t ranks_per_node,
                                       const AvailableMemory& available, bool needs_stage3 = false,
                                       double activation_bytes = 0);

// The learning rate DeepSpeed's scheduler (deepspeed/runtime/lr_schedules.py) sets when its
// last_batch_iteration is `step`, for an optimizer whose configured lr is `base_lr`; base_lr
// itself when there is no scheduler. DeepSpeed steps the scheduler after each optimizer step,
// starting from -1, so the optimizer step numbered n (0-based) runs with scheduled_lr(n - 1);
// step = -1 is the value set at construction.
double scheduled_lr(const DeepSpeedConfig& config, int64_t step, double base_lr);

// The inner optimizer's LibTorch options from optimizer_type and optimizer_params
// (torch::optim::AdamOptions, AdamWOptions or SGDOptions). Throws if the config has no
// optimizer.
std::unique_ptr<torch::optim::OptimizerOptions> make_optimizer_options(
    const DeepSpeedConfig& config);

// Whether DeepSpeed's Muon gives a parameter of this name and number of
// dimensions to its Muon half when no use_muon marks it: two or more
// dimensions and a name holding neither "embed" nor "lm_head" ([Note:
// DeepSpeed's Muon]).
bool uses_deepspeed_muon(const std::string& name, int64_t dim);

// optimizer.type "Muon" as DeepSpeed runs it, over named parameters
// (module->named_parameters().pairs()): a Muon group (MuonOptions, nesterov,
// the "original" lr adjustment) of those uses_deepspeed_muon picks and an
// Adam group (AdamW, or Adam with adam_w_mode false) of the rest, both
// RuleOptions, either left out when empty. Throws naming a picked
// parameter that is not a matrix.
std::vector<torch::optim::OptimizerParamGroup> deepspeed_muon_groups(
    const std::vector<std::pair<std::string, at::Tensor>>& named_parameters,
    const DeepSpeedConfig& config);

const char* lr_schedule_name(LrScheduleType type);

}  // namespace zeroshard
