// Engine::save_checkpoint / load_checkpoint: the optimizer's checkpoint
// (zero_optimizer_checkpoint.cpp) plus what the engine owns.
#include "zeroshard/communicator.h"
#include "zeroshard/engine.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <mutex>

namespace zeroshard {
namespace {

std::string cpu_rng_file(int64_t rank) { return "rng_cpu_" + std::to_string(rank) + ".bin"; }

std::string cpu_rng_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  const at::Tensor state = generator.get_state();
  return std::string(static_cast<const char*>(state.data_ptr()), state.numel());
}

void set_cpu_rng_state(const std::string& bytes) {
  at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

}  // namespace

std::string Engine::save_checkpoint(const std::string& save_dir, std::string tag,
                                    const nlohmann::json& client_state, CheckpointSaveOptions extra,
                                    bool save_latest) {
  if (tag.empty()) {
    tag = "global_step" + std::to_string(global_steps_);
  }
  TORCH_CHECK_VALUE(tag.find('/') == std::string::npos && tag != "." && tag != "..",
                    "checkpoint tag '", tag, "' must be a plain directory name");
  nlohmann::json replicated = extra.replicated();
  replicated["engine"] = {{"global_steps", global_steps_},
                          {"micro_steps", micro_steps_},
                          {"skipped_steps", skipped_steps_},
                          {"scheduler_steps", scheduler_steps_},
                          {"global_samples", global_steps_ * config_.train_batch_size},
                          {"train_batch_size", config_.train_batch_size},
                          {"world_size", optimizer_.communicator().world_size()}};
  replicated["loss_scaler"] = scaler_ ? nlohmann::json(scaler_->state()) : nlohmann::json();
  replicated["client_state"] = client_state;
  extra.replicated(std::move(replicated));
  extra.rank_files()[cpu_rng_file(optimizer_.checkpoint_rank())] = cpu_rng_state();
  if (save_latest) {
    extra.latest_path(checkpoint_path(save_dir, "latest")).latest_tag(tag);
  }
  const std::string path = checkpoint_path(save_dir, tag);
  optimizer_.save_checkpoint(path, extra);
  return path;
}

std::pair<std::string, nlohmann::json> Engine::load_checkpoint(const std::string& load_dir,
                                                               std::string tag,
                                                               const EngineLoadOptions& options,
                                                               LoadedCheckpoint* loaded) {
  if (tag.empty()) {
    tag = read_latest_tag(load_dir);  // every rank reads it: a shared file system
  }
  const bool optimizer_states = options.load_optimizer_states() && !options.load_module_only();
  LoadedCheckpoint result =
      optimizer_.load_checkpoint(checkpoint_path(load_dir, tag),
                                 CheckpointLoadOptions().load_optimizer_states(optimizer_states));
  const nlohmann::json& replicated = result.index.at("replicated");
  if (!options.load_module_only() && replicated.contains("engine")) {
    const auto& engine = replicated.at("engine");
    global_steps_ = engine.at("global_steps").get<int64_t>();
    micro_steps_ = engine.at("micro_steps").get<int64_t>();
    skipped_steps_ = engine.at("skipped_steps").get<int64_t>();
    steps_at_last_line_ = global_steps_;
    if (options.load_lr_scheduler_states()) {
      scheduler_steps_ = engine.at("scheduler_steps").get<int64_t>();
    }
    if (optimizer_states && scaler_ && replicated.at("loss_scaler").is_array()) {
      scaler_->load_state(replicated.at("loss_scaler").get<std::vector<double>>());
      optimizer_.set_loss_scale(scaler_->scale());
    }
    // Each rank's RNG continues where the rank with its number left off.
    auto rng = result.rank_files.find(cpu_rng_file(optimizer_.checkpoint_rank()));
    if (rng != result.rank_files.end()) {
      set_cpu_rng_state(rng->second);
    }
  }
  apply_schedule();
  nlohmann::json client_state =
      replicated.contains("client_state") ? replicated.at("client_state") : nlohmann::json();
  std::string path = result.path;
  if (loaded != nullptr) {
    *loaded = std::move(result);
  }
  return {path, client_state};
}

}  // namespace zeroshard
