// ZeroOptimizer::save_checkpoint: the resharding checkpoint of checkpoint.h,
// written synchronously or by a background thread. Loading is in
// zero_optimizer_checkpoint_load.cpp. See docs/design.md ("Checkpoints").
#include "../checkpoint/checkpoint_detail.h"
#include "../checkpoint/durable_file.h"
#include "../checkpoint/element_runs.h"
#include "zero_optimizer_impl.h"
#include "zeroshard/safetensors.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <array>
#include <filesystem>
#include <thread>

#include <sys/mman.h>

namespace zeroshard {

// [Note: Checkpoint pieces]
// A checkpoint stores states by parameter name and element range, not by
// rank: for every segment a rank owns (partition_layout.h) and every state
// (fp32 master, exp_avg, ...), one safetensors tensor
// "<state>/<parameter name>/<first element>" holding that range of the
// flattened parameter. The index lists each parameter's pieces. Loading at
// any layout intersects the ranges this rank owns now with the saved pieces,
// so world size, stage, bucket size, grouping and offload may all change.
// Padding is never stored. 16-bit parameters are not stored either: the step
// writes them as the master rounded to nearest, so the load recomputes them
// exactly.
//
// Under tensor parallelism a rank's parameter is a piece of an unsplit tensor
// (TensorParallelSplit), and ranges are ranges of the unsplit tensor's
// flattening: the index lists unsplit shapes, the files of every
// tensor-parallel rank share one directory, and a copy (Replicate) is written
// by tensor-parallel rank 0 only. A piece split along a later dimension is
// strided there, so a stored piece may be `count` runs of `run` elements
// `stride` apart (format version 2; element_runs.h). The load maps both sides
// into unsplit elements, so it reads at any tensor-parallel degree, or none.

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using checkpoint_detail::message_of;

// Host memory for an asynchronous save's copy of the state: pinned on CUDA
// (the copy out of device memory is then a DMA), else an anonymous mapping
// that goes back to the system when the write is done, whatever glibc's
// thresholds (a heap allocation of this size may stay in the process).
at::Tensor host_staging(int64_t numel, c10::Device device) {
  if (numel == 0) {
    return at::empty({0}, at::kFloat);
  }
  if (device.is_cuda()) {
    return at::empty({numel}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
  }
  const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
  void* memory = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(memory != MAP_FAILED, "cannot map ", bytes,
              " bytes of host memory for an asynchronous checkpoint save");
  return at::from_blob(
      memory, {numel}, [bytes](void* p) { ::munmap(p, bytes); }, at::kFloat);
}

}  // namespace

at::Tensor ZeroOptimizer::Impl::read_state(size_t g, OptimizerStateName name, int64_t offset,
                                           int64_t length) const {
  if (name == OptimizerStateName::kMaster) {
    return read_master(g, offset, length);
  }
  // Written to a file from the host: a device moment is read in place.
  at::Tensor in_place = storage().view(g, name, offset, length);
  return in_place.defined()
             ? in_place
             : storage().read(g, name, offset, length, fp32_options().device(c10::kCPU));
}

json ZeroOptimizer::Impl::checkpoint_index_skeleton(const CheckpointSaveOptions& options) const {
  json index = {{"format", "zeroshard-checkpoint"},
                {"format_version", kCheckpointFormatVersion},
                {"zeroshard_version", "0.1.0"},
                {"world_size", groups_->checkpoint_writer_count()},
                {"tensor_parallel_size",
                 groups_->model_parallel() ? groups_->model_parallel()->world_size() : 1},
                {"stage", options_.stage()},
                {"inner_optimizer", rule_name()},
                {"offload_optimizer", offload_device_name(options_.offload_optimizer().device())},
                {"reduce_bucket_size", options_.reduce_bucket_size()},
                {"files", json::array()},
                {"groups", json::array()},
                {"params", json::array()},
                {"replicated", options.replicated()},
                {"replicated_files", json::object()},
                {"rank_files", json::array()}};
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    json group = {
        {"hyperparameters", inner_options_to_json(inner_kind_, param_groups_[g].options())},
        {"params", json::array()}};
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
      const at::Tensor& param = param_groups_[g].params()[i];
      const std::string name = parameter_name(g, i);
      group["params"].push_back(name);
      index["params"].push_back(
          {{"name", name},
           {"aliases", parameter_aliases(g, i)},
           {"shape", tensor_parallel_split(g, i).full_shape},
           {"dtype", safetensors_dtype_name(param.scalar_type())},
           {"group", g},
           {"rule", update_rule_name(inner_kind_, param_groups_[g].options())},
           {"step", buffers_[g].steps[i]},
           {"states", json::object()}});
      // The shapes of parameter states, which are not the parameter's.
      const std::vector<ParameterStateSpec> specs = ParameterStates::specs(param_groups_[g], i);
      if (!specs.empty()) {
        json shapes = json::object();
        for (const ParameterStateSpec& spec : specs) {
          shapes[spec.name] = spec.sizes;
        }
        index["params"].back()["state_shapes"] = std::move(shapes);
      }
    }
    index["groups"].push_back(std::move(group));
  }
  return index;
}

void ZeroOptimizer::Impl::save_checkpoint_shards(const std::string& path_in,
                                                 const CheckpointSaveOptions& options) {
  // One save at a time: the previous asynchronous one first; its failure is
  // reported through the first agreement, so every rank raises together.
  std::string error = async_saver_.finish();
  const std::string path = checkpoint_path(path_in, "");
  const std::string staging = path + ".tmp";
  const int64_t rank = checkpoint_rank();
  const int64_t world = groups_->checkpoint_writer_count();
  // The asynchronous commit's store and key, taken on every rank alike
  // (before any collective, so that a refusal is raised by all).
  std::pair<c10::intrusive_ptr<c10d::Store>, std::string> commit;
  if (options.async_save()) {
    // Every rank has the same placement: all refuse alike, before any collective.
    TORCH_CHECK_VALUE(!offloaded_ || placement_->offload_tier() != StateTier::kNVMe,
                      "async_save copies the whole optimizer state into host memory, which NVMe "
                      "offload keeps it out of; save with async_save=False (it streams from the "
                      "swap space a piece at a time)");
    commit = async_saver_.next_commit(path, *groups_);
  }
  if (rank == 0 && error.empty()) {
    try {
      std::string removal_error;
      TORCH_CHECK(checkpoint_detail::remove_tree(staging, &removal_error), "cannot remove ",
                  staging, " (what an interrupted save left): ", removal_error);
      fs::create_directories(staging);
    } catch (const std::exception& e) {
      error = "cannot create " + staging + ": " + message_of(e);
    }
  }
  // Every owned segment of every state, in shard order, as runs of the
  // unsplit tensor (one run without tensor parallelism).
  struct Source {
    size_t group;
    OptimizerStateName state;
    int64_t shard_offset;  // in the shard, or in the group's parameter states
    int64_t numel;
    bool parameter_state = false;  // [Note: parameter states]
  };
  std::vector<Source> sources;
  std::vector<checkpoint_detail::PieceSpec> pieces;
  if (error.empty()) {
    try {
      for (size_t g = 0; g < buffers_.size(); ++g) {
        for (const ShardSegment& segment : buffers_[g].segments) {
          const size_t i = segment.param_index;
          if (!writes_checkpoint_piece(g, i)) {
            continue;
          }
          const auto runs = checkpoint_detail::unsplit_runs(tensor_parallel_split(g, i),
                                                            param_groups_[g].params()[i].sizes(),
                                                            segment.param_offset, segment.numel);
          for (OptimizerStateName state : all_optimizer_states()) {
            if (!storage().has(g, state)) {
              continue;
            }
            int64_t offset = segment.shard_offset;
            for (const auto& run : runs) {
              const bool strided = run.count > 1;
              sources.push_back({g, state, offset, run.numel()});
              pieces.push_back({parameter_name(g, i), optimizer_state_name(state), run.begin,
                                run.numel(), strided ? run.run : 0, strided ? run.stride : 0});
              offset += run.numel();
            }
          }
          // Whole parameters' states of their own shapes, as pieces of their
          // own flattening.
          for (const ParameterStates::Entry& entry : parameter_states_.entries(g, i)) {
            sources.push_back({g, entry.name, entry.offset, entry.numel, true});
            pieces.push_back(
                {parameter_name(g, i), optimizer_state_name(entry.name), 0, entry.numel, 0, 0});
          }
        }
      }
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  agree_on_checkpoint_errors(error, "prepare checkpoint directory " + staging);
  at::NoGradGuard no_grad;
  auto read_source = [this, &sources](size_t i) {
    const Source& s = sources[i];
    return s.parameter_state ? parameter_states_.flat(s.group).narrow(0, s.shard_offset, s.numel)
                             : read_state(s.group, s.state, s.shard_offset, s.numel);
  };

  if (!options.async_save()) {
    json manifest;
    try {
      manifest = checkpoint_detail::write_rank_file(staging, rank, world, pieces, read_source,
                                                    options.rank_files());
      if (groups_->model_parallel()) {
        // Expert-parallel ranks hold other experts: each lists its own
        // parameters, and the index is their union.
        manifest["params"] = checkpoint_index_skeleton(options).at("params");
      }
      checkpoint_detail::maybe_inject_fault("after_rank_file", rank);
    } catch (const std::exception& e) {
      error = message_of(e);
    }
    agree_on_checkpoint_errors(error, "write checkpoint " + path);
    const auto manifests = groups_->all_gather_among_writers(manifest.dump(), "checkpoint");
    if (rank == 0) {
      try {
        json index = checkpoint_index_skeleton(options);
        checkpoint_detail::merge_manifests(index, manifests);
        checkpoint_detail::publish(index, staging, path, options);
      } catch (const std::exception& e) {
        error = message_of(e);
      }
    }
    agree_on_checkpoint_errors(error, "commit checkpoint " + path);
    return;
  }

  // Asynchronous: copy the state now (the training may change it as soon as
  // this returns); a background thread writes the copy and commits.
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const auto& spec : pieces) {
    offsets.push_back(total);
    total += spec.numel;
  }
  at::Tensor copy = host_staging(total, device());
  for (size_t i = 0; i < sources.size(); ++i) {
    copy.narrow(0, offsets[i], pieces[i].numel).copy_(read_source(i));
  }
  json skeleton = rank == 0 ? checkpoint_index_skeleton(options) : json();
  // Expert-parallel ranks hold other experts: each lists its own parameters
  // (as the synchronous save does), and the index is their union.
  json own_params =
      groups_->model_parallel() ? checkpoint_index_skeleton(options).at("params") : json();
  const std::string key = commit.second;
  c10::intrusive_ptr<c10d::Store> store = BackgroundSave::own_connection(commit.first);
  async_saver_.start(
      path, [store, key, rank, world, staging, path, options, pieces = std::move(pieces),
             offsets = std::move(offsets), copy = std::move(copy), skeleton = std::move(skeleton),
             own_params = std::move(own_params)]() mutable {
        std::string local_error;
        json manifest;
        try {
          manifest = checkpoint_detail::write_rank_file(
              staging, rank, world, pieces,
              [&](size_t i) { return copy.narrow(0, offsets[i], pieces[i].numel); },
              options.rank_files());
          if (!own_params.is_null()) {
            manifest["params"] = std::move(own_params);
          }
          checkpoint_detail::maybe_inject_fault("after_rank_file", rank);
        } catch (const std::exception& e) {
          local_error = message_of(e);
        }
        copy = at::Tensor();  // the data is on disk: give the memory back now
        return checkpoint_detail::commit_through_store(store.get(), key, rank, world, local_error,
                                                       manifest, std::move(skeleton), staging, path,
                                                       options);
      });
}

bool ZeroOptimizer::Impl::checkpoint_in_flight() const { return async_saver_.in_flight(); }

void ZeroOptimizer::Impl::set_checkpoint_store(c10::intrusive_ptr<c10d::Store> store,
                                               std::string prefix) {
  async_saver_.set_store(std::move(store), std::move(prefix));
}

void ZeroOptimizer::Impl::wait_for_checkpoint() { async_saver_.wait(); }

}  // namespace zeroshard
