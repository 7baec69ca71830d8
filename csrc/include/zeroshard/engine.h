// zeroshard::Engine: the training-loop driver DeepSpeed users know from
// deepspeed.initialize, over a ZeroOptimizer built from the same JSON config.
//
//   auto config = zeroshard::load_deepspeed_config("ds_config.json", world_size);
//   auto optimizer = zeroshard::make_optimizer(model->parameters(), pg, config);
//   zeroshard::Engine engine(*optimizer, config);
//   for (...) {
//     at::Tensor loss = engine.forward([&] { return loss_fn(model->forward(x), y); });
//     engine.backward(loss);  // scales (fp16) and divides by the accumulation steps
//     engine.step();          // acts at accumulation boundaries
//   }
//
// At a boundary step() unscales the gradients, skips the step on every rank if
// any rank's gradients overflowed (fp16, or bf16 with check_grad_overflow),
// updates the loss scale, clips, updates the shards, sets the scheduler's
// learning rate and zeroes the gradients. Every steps_per_print steps rank 0
// prints one telemetry line (and appends it as JSON to telemetry_file).
//
// Thread-safety: drive it from one thread, like the optimizer.
#pragma once

#include "zeroshard/deepspeed_config.h"
#include "zeroshard/loss_scaler.h"
#include "zeroshard/zero_optimizer.h"

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard {

// What Engine::load_checkpoint restores, as DeepSpeed's load_checkpoint.
struct EngineLoadOptions {
  // Optimizer moments, step counts, hyper-parameters and the loss scaler.
  TORCH_ARG(bool, load_optimizer_states) = true;
  // The position in the learning-rate schedule.
  TORCH_ARG(bool, load_lr_scheduler_states) = true;
  // The weights only: no optimizer state, schedule or engine counters.
  TORCH_ARG(bool, load_module_only) = false;
};

// One telemetry line: means over the steps since the previous line.
struct TelemetryRecord {
  int64_t step = 0;  // global steps so far
  double loss = 0;   // of the last step, unscaled, averaged over its micro-batches
  double lr = 0;     // of the first parameter group
  double loss_scale = 1;
  int64_t skipped_steps = 0;
  double forward_ms = 0;  // per step, summed over its micro-batches
  double backward_ms = 0;
  double optimizer_ms = 0;
  double comm_wait_share = 0;      // of forward + backward + optimizer time
  int64_t model_state_bytes = 0;   // parameters + gradients + optimizer state held now
  int64_t peak_rss_bytes = 0;      // process peak resident set (VmHWM)
  int64_t device_peak_bytes = -1;  // e.g. CUDA max allocated, when a source is set
  double comm_mib_per_step = 0;    // sent by this rank (wall_clock_breakdown only)
  // NVMe offload (optimizer state and parameter swap spaces together), per
  // step: bytes read and written, the share of forward + backward + optimizer
  // time spent waiting for I/O, and the bytes moved per second of that time.
  bool nvme = false;
  double nvme_read_bytes = 0;
  double nvme_written_bytes = 0;
  double nvme_wait_share = 0;
  double nvme_gb_per_s = 0;
  std::string to_line() const;  // "step=10 loss=2.3 ..." (key=value, space separated)
  std::string to_json() const;
};

// The ZeroOptimizer a config describes: inner optimizer and hyper-parameters,
// ZeRO options, fp16/bf16 overflow skipping. zero_optimization.stage 0 runs as
// stage 1 (same results; optimizer state sharded).
std::unique_ptr<ZeroOptimizer> make_optimizer(std::vector<at::Tensor> params,
                                              c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                              const DeepSpeedConfig& config,
                                              std::vector<ParameterUnit> units = {});
// With hybrid sharding (zero_hpz_partition_size > 1): `process_group` is this
// rank's shard group and `replicate_group` its replicate group, e.g. from
// make_hybrid_gloo_groups (gloo_process_group.h) or a DeviceMesh in Python.
std::unique_ptr<ZeroOptimizer> make_optimizer(
    std::vector<at::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    c10::intrusive_ptr<c10d::ProcessGroup> replicate_group, const DeepSpeedConfig& config,
    std::vector<ParameterUnit> units = {});
// Over named parameters (module->named_parameters().pairs()), which also name
// them in checkpoints: as above, and optimizer.type "Muon" as DeepSpeed runs
// it, a Muon group and an Adam group (deepspeed_muon_groups).
std::unique_ptr<ZeroOptimizer> make_optimizer(
    const std::vector<std::pair<std::string, at::Tensor>>& named_parameters,
    c10::intrusive_ptr<c10d::ProcessGroup> process_group, const DeepSpeedConfig& config,
    std::vector<ParameterUnit> units = {});
// Throws, naming both, where the groups' sizes are not what the config's
// world size and zero_hpz_partition_size say.
void check_groups_match_config(const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
                               const c10::intrusive_ptr<c10d::ProcessGroup>& replicate_group,
                               const DeepSpeedConfig& config);
// The ZeroOptions a config describes (also used by the Python layer).
ZeroOptions zero_options_from_config(const DeepSpeedConfig& config);

class Engine {
 public:
  // `optimizer` must outlive the engine; build it with make_optimizer (or
  // with options equivalent to zero_options_from_config(config)).
  Engine(ZeroOptimizer& optimizer, DeepSpeedConfig config);

  template <typename Fn>
  auto forward(Fn&& fn) {
    begin_forward();
    auto output = fn();
    end_forward();
    return output;
  }
  void begin_forward();
  void end_forward();

  // Collective at stages 2 and 3 (gradient hooks).
  void backward(const at::Tensor& loss);
  // Collective at a boundary. Returns true when an optimizer step was applied
  // at this call (false between boundaries and when the step was skipped).
  bool step();

  // Whether the next step() call ends an accumulation window.
  bool is_gradient_accumulation_boundary() const;
  int64_t global_steps() const { return global_steps_; }
  int64_t micro_steps() const { return micro_steps_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t train_batch_size() const { return config_.train_batch_size; }
  int64_t train_micro_batch_size_per_gpu() const { return config_.train_micro_batch_size_per_gpu; }
  int64_t gradient_accumulation_steps() const { return config_.gradient_accumulation_steps; }
  // Learning rate of each parameter group now.
  std::vector<double> get_lr() const;
  double loss_scale() const { return scaler_ ? scaler_->scale() : 1.0; }

  // Collective. Saves a checkpoint to <save_dir>/<tag> (default tag
  // "global_step<N>") with the engine's state (counters, loss scaler, schedule
  // position, each rank's CPU RNG state) and `client_state`, then points
  // <save_dir>/latest at it (as DeepSpeed does, but atomically). `extra` adds
  // files and replicated entries. Returns the checkpoint's path.
  std::string save_checkpoint(const std::string& save_dir, std::string tag = "",
                              const nlohmann::json& client_state = nlohmann::json::object(),
                              CheckpointSaveOptions extra = {}, bool save_latest = true);
  // Collective. Loads <load_dir>/<tag> (default: the tag `latest` names),
  // saved at any world size or stage. Returns the path and the client_state;
  // `loaded`, when given, receives the rest (extra files, index).
  std::pair<std::string, nlohmann::json> load_checkpoint(const std::string& load_dir,
                                                         std::string tag = "",
                                                         const EngineLoadOptions& options = {},
                                                         LoadedCheckpoint* loaded = nullptr);

  ZeroOptimizer& optimizer() { return optimizer_; }
  const DeepSpeedConfig& config() const { return config_; }
  const std::optional<TelemetryRecord>& last_telemetry() const { return last_telemetry_; }
  // A source of peak device memory for telemetry (the Python layer passes
  // torch.cuda.max_memory_allocated on GPU).
  void set_device_peak_source(std::function<int64_t()> source) {
    device_peak_source_ = std::move(source);
  }

 private:
  void apply_schedule();
  void emit_telemetry();

  ZeroOptimizer& optimizer_;
  DeepSpeedConfig config_;
  std::optional<LossScaler> scaler_;  // fp16 only
  std::vector<double> base_lrs_;      // per group, as configured
  int64_t micro_steps_ = 0;
  int64_t global_steps_ = 0;
  int64_t scheduler_steps_ = 0;  // steps applied (the scheduler does not advance on a skip)
  int64_t skipped_steps_ = 0;
  at::Tensor loss_sum_;       // this window's micro-batch losses, unscaled
  at::Tensor last_loss_sum_;  // the last window's, read when a line prints
  // Telemetry accumulators since the last line.
  std::chrono::steady_clock::time_point forward_start_;
  double forward_s_ = 0, backward_s_ = 0, optimizer_s_ = 0;
  double wait_s_at_last_line_ = 0;
  double comm_bytes_at_last_line_ = 0;  // sent by this rank (CommStats::wire_bytes)
  // NVMe totals (read, written, wait) at the last line; see TelemetryRecord.
  int64_t nvme_read_at_last_line_ = 0;
  int64_t nvme_written_at_last_line_ = 0;
  double nvme_wait_at_last_line_ = 0;
  int64_t steps_at_last_line_ = 0;
  std::optional<TelemetryRecord> last_telemetry_;
  std::function<int64_t()> device_peak_source_;
};

}  // namespace zeroshard
