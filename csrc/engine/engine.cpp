#include "zeroshard/engine.h"
#include "zeroshard/communicator.h"
#include "zeroshard/nvme_gradient_swapper.h"
#include "zeroshard/nvme_parameter_swapper.h"
#include "zeroshard/nvme_state_swapper.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace zeroshard {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Peak resident set of this process, from /proc (Linux); 0 elsewhere.
int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      return std::stoll(line.substr(6)) * 1024;
    }
  }
  return 0;
}

}  // namespace

ZeroOptions zero_options_from_config(const DeepSpeedConfig& config) {
  ZeroOptions options = config.zero;
  if (config.zero_stage == 0) {
    options.stage(1);
  }
  options.skip_nonfinite_steps(config.fp16.enabled ||
                               (config.bf16.enabled && config.bf16.check_grad_overflow));
  return options;
}

std::unique_ptr<ZeroOptimizer> make_optimizer(std::vector<at::Tensor> params,
                                              c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                              const DeepSpeedConfig& config,
                                              std::vector<ParameterUnit> units) {
  return make_optimizer(std::move(params), std::move(process_group), {}, config, std::move(units));
}

std::unique_ptr<ZeroOptimizer> make_optimizer(
    std::vector<at::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    c10::intrusive_ptr<c10d::ProcessGroup> replicate_group, const DeepSpeedConfig& config,
    std::vector<ParameterUnit> units) {
  check_groups_match_config(process_group, replicate_group, config);
  const auto inner = make_optimizer_options(config);
  std::vector<torch::optim::OptimizerParamGroup> groups{
      torch::optim::OptimizerParamGroup(std::move(params))};
  return std::make_unique<ZeroOptimizer>(groups, std::move(process_group),
                                         std::move(replicate_group), *inner,
                                         zero_options_from_config(config), std::move(units));
}

void check_groups_match_config(const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
                               const c10::intrusive_ptr<c10d::ProcessGroup>& replicate_group,
                               const DeepSpeedConfig& config) {
  TORCH_CHECK_VALUE(process_group, "make_optimizer needs a process group; got a null one");
  const int64_t shard_size = process_group->getSize();
  const int64_t replicas = replicate_group ? replicate_group->getSize() : 1;
  // zero_hpz_partition_size 1 (or 0): one shard group of every rank.
  const int64_t expected_shard =
      config.shard_group_size > 1 ? config.shard_group_size : config.world_size;
  TORCH_CHECK_VALUE(shard_size == expected_shard && shard_size * replicas == config.world_size,
                    "the config (world size ", config.world_size, ", zero_hpz_partition_size ",
                    config.shard_group_size, ") expects shard groups of ", expected_shard,
                    " ranks and ", config.world_size / expected_shard,
                    " replicas; got a shard group of ", shard_size, " ranks and ", replicas,
                    " replicas (build both groups with make_hybrid_gloo_groups, or pass the "
                    "world group when zero_hpz_partition_size is 1)");
}

std::unique_ptr<ZeroOptimizer> make_optimizer(
    const std::vector<std::pair<std::string, at::Tensor>>& named_parameters,
    c10::intrusive_ptr<c10d::ProcessGroup> process_group, const DeepSpeedConfig& config,
    std::vector<ParameterUnit> units) {
  std::unique_ptr<ZeroOptimizer> optimizer;
  if (config.optimizer_type != "Muon") {
    std::vector<at::Tensor> params;
    for (const auto& named : named_parameters) {
      params.push_back(named.second);
    }
    optimizer = make_optimizer(std::move(params), process_group, config, std::move(units));
  } else {
    TORCH_CHECK_VALUE(config.shard_group_size <= 1,
                      "optimizer.type \"Muon\" with zero_hpz_partition_size > 1: build the "
                      "groups with deepspeed_muon_groups and the ZeroOptimizer with both "
                      "process groups");
    check_groups_match_config(process_group, nullptr, config);
    const std::vector<torch::optim::OptimizerParamGroup> groups =
        deepspeed_muon_groups(named_parameters, config);
    TORCH_CHECK_VALUE(!groups.empty(), "make_optimizer was given no parameters");
    optimizer = std::make_unique<ZeroOptimizer>(groups, std::move(process_group), nullptr,
                                                groups.front().options(),
                                                zero_options_from_config(config), std::move(units));
  }
  optimizer->set_parameter_names(named_parameters);
  return optimizer;
}

namespace {

// This rank's collectives so far, the shard group's and (hybrid sharding)
// the replicas': lifetime counters, so that a user's reset_comm_stats()
// between two lines cannot make a difference negative.
struct CommTotals {
  double wait_seconds = 0;
  double wire_bytes = 0;  // sent by this rank (CommStats::wire_bytes)
};

CommTotals comm_totals(ZeroOptimizer& optimizer) {
  CommTotals totals;
  for (Communicator* comm : {&optimizer.communicator(), optimizer.replica_communicator()}) {
    if (comm != nullptr) {
      const CommStats stats = comm->lifetime_stats();
      totals.wait_seconds += stats.wait_seconds;
      totals.wire_bytes += stats.wire_bytes(comm->world_size());
    }
  }
  return totals;
}

}  // namespace

std::string TelemetryRecord::to_line() const {
  std::ostringstream out;
  out << "step=" << step << " loss=" << std::setprecision(6) << loss << " lr=" << std::scientific
      << std::setprecision(4) << lr << std::defaultfloat << " loss_scale=" << loss_scale
      << " skipped=" << skipped_steps << std::fixed << std::setprecision(2)
      << " forward_ms=" << forward_ms << " backward_ms=" << backward_ms
      << " optimizer_ms=" << optimizer_ms << " comm_wait=" << 100 * comm_wait_share << "%"
      << " model_states_MiB=" << model_state_bytes / 1048576.0
      << " peak_rss_MiB=" << peak_rss_bytes / 1048576.0;
  if (device_peak_bytes >= 0) {
    out << " device_peak_MiB=" << device_peak_bytes / 1048576.0;
  }
  if (comm_mib_per_step > 0) {
    // Four significant digits: a small model sends well under 0.01 MiB.
    out << " comm_MiB_per_step=" << std::defaultfloat << std::setprecision(4) << comm_mib_per_step
        << std::fixed << std::setprecision(2);
  }
  if (nvme) {
    out << " nvme_read_MiB=" << nvme_read_bytes / 1048576.0
        << " nvme_written_MiB=" << nvme_written_bytes / 1048576.0
        << " nvme_wait=" << 100 * nvme_wait_share << "%"
        << " nvme_GB_per_s=" << nvme_gb_per_s;
  }
  return out.str();
}

std::string TelemetryRecord::to_json() const {
  std::ostringstream out;
  out << std::setprecision(17) << "{\"step\": " << step << ", \"loss\": " << loss
      << ", \"lr\": " << lr << ", \"loss_scale\": " << loss_scale
      << ", \"skipped_steps\": " << skipped_steps << ", \"forward_ms\": " << forward_ms
      << ", \"backward_ms\": " << backward_ms << ", \"optimizer_ms\": " << optimizer_ms
      << ", \"comm_wait_share\": " << comm_wait_share
      << ", \"model_state_bytes\": " << model_state_bytes
      << ", \"peak_rss_bytes\": " << peak_rss_bytes
      << ", \"device_peak_bytes\": " << device_peak_bytes
      << ", \"comm_mib_per_step\": " << comm_mib_per_step;
  if (nvme) {
    out << ", \"nvme_read_bytes\": " << nvme_read_bytes
        << ", \"nvme_written_bytes\": " << nvme_written_bytes
        << ", \"nvme_wait_share\": " << nvme_wait_share << ", \"nvme_gb_per_s\": " << nvme_gb_per_s;
  }
  out << "}";
  return out.str();
}

Engine::Engine(ZeroOptimizer& optimizer, DeepSpeedConfig config)
    : optimizer_(optimizer), config_(std::move(config)) {
  check_supported(config_);
  if (config_.fp16.enabled) {
    TORCH_CHECK_VALUE(optimizer_.zero_options().skip_nonfinite_steps(),
                      "fp16 loss scaling needs an optimizer built with skip_nonfinite_steps "
                      "(zeroshard::make_optimizer / zero_options_from_config set it)");
    scaler_.emplace(config_.fp16);
    optimizer_.set_loss_scale(scaler_->scale());
  }
  for (const auto& group : optimizer_.param_groups()) {
    base_lrs_.push_back(group.options().get_lr());
  }
  apply_schedule();
  // Telemetry counts from here: construction's collectives are not training.
  const CommTotals comm = comm_totals(optimizer_);
  wait_s_at_last_line_ = comm.wait_seconds;
  comm_bytes_at_last_line_ = comm.wire_bytes;
  // The swap spaces' construction-time writes are not a step's.
  if (const NvmeStateSwapper* states = optimizer_.nvme_swapper()) {
    nvme_read_at_last_line_ += states->bytes_read();
    nvme_written_at_last_line_ += states->bytes_written();
    nvme_wait_at_last_line_ += states->io_wait_seconds();
  }
  if (const NvmeParameterSwapper* params = optimizer_.parameter_swapper()) {
    nvme_read_at_last_line_ += params->bytes_read();
    nvme_written_at_last_line_ += params->bytes_written();
    nvme_wait_at_last_line_ += params->io_wait_seconds();
  }
  if (const NvmeGradientSwapper* grads = optimizer_.gradient_swapper()) {
    nvme_read_at_last_line_ += grads->bytes_read();
    nvme_written_at_last_line_ += grads->bytes_written();
    nvme_wait_at_last_line_ += grads->io_wait_seconds();
  }
  if (optimizer_.communicator().rank() == 0 && config_.zero_stage == 0) {
    std::printf(
        "[zeroshard] zero_optimization.stage 0 runs as stage 1 (same results; the optimizer "
        "state is sharded)\n");
  }
  if (optimizer_.communicator().rank() == 0 && !config_.telemetry_file.empty()) {
    std::ofstream(config_.telemetry_file, std::ios::trunc);  // a fresh file per run
  }
}

void Engine::begin_forward() { forward_start_ = std::chrono::steady_clock::now(); }

void Engine::end_forward() { forward_s_ += seconds_since(forward_start_); }

void Engine::backward(const at::Tensor& loss) {
  TORCH_CHECK_VALUE(loss.defined() && loss.numel() == 1,
                    "engine.backward expects the scalar loss, got a tensor of shape ",
                    loss.defined() ? loss.sizes() : at::IntArrayRef{});
  const auto start = std::chrono::steady_clock::now();
  {
    at::NoGradGuard no_grad;
    at::Tensor detached = loss.detach().to(at::kDouble).reshape({});
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + detached : detached;
  }
  // DeepSpeed divides the loss by the accumulation steps, so the summed
  // gradients are the mean over the global batch.
  const double factor = loss_scale() / static_cast<double>(config_.gradient_accumulation_steps);
  at::Tensor scaled = loss.to(at::kFloat) * factor;
  scaled.backward();
  backward_s_ += seconds_since(start);
}

bool Engine::is_gradient_accumulation_boundary() const {
  return (micro_steps_ + 1) % config_.gradient_accumulation_steps == 0;
}

void Engine::apply_schedule() {
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    groups[g].options().set_lr(scheduled_lr(config_, scheduler_steps_ - 1, base_lrs_[g]));
  }
}

std::vector<double> Engine::get_lr() const {
  std::vector<double> lrs;
  for (const auto& group : optimizer_.param_groups()) {
    lrs.push_back(group.options().get_lr());
  }
  return lrs;
}

bool Engine::step() {
  const bool boundary = is_gradient_accumulation_boundary();
  micro_steps_ += 1;
  if (!boundary) {
    return false;
  }
  const auto start = std::chrono::steady_clock::now();
  optimizer_.step();
  const bool skipped = optimizer_.last_step_skipped();
  if (skipped && config_.raise_on_nonfinite) {
    // Leave a clean window for a caller that catches the error.
    optimizer_.zero_grad();
    loss_sum_ = at::Tensor();
  }
  // Every rank saw the same flag, so every rank raises.
  TORCH_CHECK(!(skipped && config_.raise_on_nonfinite), "step ", global_steps_,
              ": the gradients hold inf or NaN on some rank (bf16.check_grad_overflow with "
              "zeroshard.on_nonfinite = \"raise\"); parameters were left unchanged");
  if (scaler_) {
    // Throws, on every rank alike, when the scale is already at its minimum.
    scaler_->update(skipped);
    optimizer_.set_loss_scale(scaler_->scale());
  }
  if (skipped) {
    skipped_steps_ += 1;
  } else {
    scheduler_steps_ += 1;
    apply_schedule();
  }
  global_steps_ += 1;
  optimizer_.zero_grad();
  optimizer_s_ += seconds_since(start);
  if (loss_sum_.defined()) {
    // Read when a line prints, not here: a read each step would make the
    // host wait for the device every step ([Note: host syncs, counted]).
    last_loss_sum_ = std::move(loss_sum_);
    loss_sum_ = at::Tensor();
  }
  if (global_steps_ % config_.steps_per_print == 0) {
    emit_telemetry();
  }
  return !skipped;
}

void Engine::emit_telemetry() {
  const CommTotals comm = comm_totals(optimizer_);
  const auto steps = static_cast<double>(global_steps_ - steps_at_last_line_);
  TelemetryRecord record;
  record.step = global_steps_;
  record.loss =
      last_loss_sum_.defined()
          ? read_to_host(last_loss_sum_, &optimizer_.host_sync_counter(), HostSync::kTelemetry)
                    .item<double>() /
                static_cast<double>(config_.gradient_accumulation_steps)
          : 0.0;
  record.lr = get_lr().front();
  record.loss_scale = loss_scale();
  record.skipped_steps = skipped_steps_;
  record.forward_ms = 1e3 * forward_s_ / steps;
  record.backward_ms = 1e3 * backward_s_ / steps;
  record.optimizer_ms = 1e3 * optimizer_s_ / steps;
  const double busy = forward_s_ + backward_s_ + optimizer_s_;
  record.comm_wait_share = busy > 0 ? (comm.wait_seconds - wait_s_at_last_line_) / busy : 0;
  record.model_state_bytes = optimizer_.parameter_bytes() + optimizer_.gradient_bytes() +
                             optimizer_.optimizer_state_bytes();
  record.peak_rss_bytes = peak_rss_bytes();
  record.device_peak_bytes = device_peak_source_ ? device_peak_source_() : -1;
  if (config_.wall_clock_breakdown) {
    record.comm_mib_per_step = (comm.wire_bytes - comm_bytes_at_last_line_) / 1048576.0 / steps;
  }
  int64_t nvme_read = 0;
  int64_t nvme_written = 0;
  double nvme_wait = 0;
  const NvmeStateSwapper* states = optimizer_.nvme_swapper();
  const NvmeParameterSwapper* params = optimizer_.parameter_swapper();
  if (states != nullptr) {
    nvme_read += states->bytes_read();
    nvme_written += states->bytes_written();
    nvme_wait += states->io_wait_seconds();
  }
  if (params != nullptr) {
    nvme_read += params->bytes_read();
    nvme_written += params->bytes_written();
    nvme_wait += params->io_wait_seconds();
  }
  if (const NvmeGradientSwapper* grads = optimizer_.gradient_swapper()) {
    nvme_read += grads->bytes_read();
    nvme_written += grads->bytes_written();
    nvme_wait += grads->io_wait_seconds();
  }
  record.nvme = states != nullptr || params != nullptr;
  if (record.nvme) {
    const auto moved = static_cast<double>(nvme_read - nvme_read_at_last_line_ + nvme_written -
                                           nvme_written_at_last_line_);
    record.nvme_read_bytes = static_cast<double>(nvme_read - nvme_read_at_last_line_) / steps;
    record.nvme_written_bytes =
        static_cast<double>(nvme_written - nvme_written_at_last_line_) / steps;
    record.nvme_wait_share = busy > 0 ? (nvme_wait - nvme_wait_at_last_line_) / busy : 0;
    record.nvme_gb_per_s = busy > 0 ? moved / busy / 1e9 : 0;
  }
  nvme_read_at_last_line_ = nvme_read;
  nvme_written_at_last_line_ = nvme_written;
  nvme_wait_at_last_line_ = nvme_wait;
  forward_s_ = backward_s_ = optimizer_s_ = 0;
  wait_s_at_last_line_ = comm.wait_seconds;
  comm_bytes_at_last_line_ = comm.wire_bytes;
  steps_at_last_line_ = global_steps_;
  if (optimizer_.communicator().rank() == 0) {
    std::printf("[zeroshard] %s\n", record.to_line().c_str());
    std::fflush(stdout);
    if (!config_.telemetry_file.empty()) {
      std::ofstream(config_.telemetry_file, std::ios::app) << record.to_json() << "\n";
    }
  }
  last_telemetry_ = record;
}

}  // namespace zeroshard
