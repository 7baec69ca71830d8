// ZeroOptimizer::load_checkpoint: reads the ranges this rank owns now from a
// checkpoint saved at any layout. See [Note: Checkpoint pieces] in
// zero_optimizer_checkpoint.cpp and docs/design.md ("Checkpoints").
#include "../checkpoint/checkpoint_detail.h"
#include "../checkpoint/durable_file.h"
#include "../checkpoint/element_runs.h"
#include "zero_optimizer_impl.h"
#include "zeroshard/crc32c.h"
#include "zeroshard/safetensors.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <optional>
#include <sstream>
#include <unordered_map>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using checkpoint_detail::join;
using checkpoint_detail::message_of;

std::string verified_file(const std::string& dir, const std::string& name, const json& record) {
  const std::string path = join(dir, name);
  TORCH_CHECK_VALUE(fs::exists(path), "checkpoint file ", path, " is missing");
  std::string content = checkpoint_detail::read_whole_file(path);
  TORCH_CHECK_VALUE(
      content.size() == record.at("bytes").get<size_t>() &&
          crc32c(content.data(), content.size()) == record.at("crc32c").get<uint32_t>(),
      "checkpoint file ", path, " is corrupt (size or CRC-32C differs from ", kCheckpointIndexFile,
      ")");
  return content;
}

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

std::string shape_string(const json& shape) {
  return shape_string(at::IntArrayRef(shape.get<std::vector<int64_t>>()));
}

}  // namespace

std::string checkpoint_path(const std::string& dir, const std::string& tag) {
  fs::path path = fs::path(dir) / tag;
  std::string text = path.lexically_normal().string();
  while (text.size() > 1 && text.back() == '/') {
    text.pop_back();
  }
  return text;
}

json read_checkpoint_index(const std::string& path) {
  const std::string index_path = join(path, kCheckpointIndexFile);
  TORCH_CHECK_VALUE(fs::exists(index_path), "no zeroshard checkpoint at ", path, ": ", index_path,
                    " is missing",
                    fs::exists(path + ".tmp") ? " (an unfinished save left " + path + ".tmp)" : "");
  json index;
  try {
    index = json::parse(checkpoint_detail::read_whole_file(index_path));
  } catch (const json::exception& e) {
    TORCH_CHECK_VALUE(false, index_path, " is not valid JSON: ", e.what());
  }
  TORCH_CHECK_VALUE(index.value("format", "") == "zeroshard-checkpoint", index_path,
                    " is not a zeroshard checkpoint index");
  const int64_t version = index.value("format_version", 0);
  TORCH_CHECK_VALUE(version >= 1 && version <= kCheckpointFormatVersion, index_path,
                    " has format version ", version, "; this build reads versions 1 to ",
                    kCheckpointFormatVersion);
  return index;
}

std::string read_latest_tag(const std::string& dir) {
  const std::string latest = join(dir, "latest");
  TORCH_CHECK_VALUE(fs::exists(latest), "no tag given and ", latest,
                    " does not exist: pass the tag of the checkpoint to load");
  std::string tag = checkpoint_detail::read_whole_file(latest);
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ' || tag.back() == '\r')) {
    tag.pop_back();
  }
  TORCH_CHECK_VALUE(!tag.empty(), latest, " is empty");
  return tag;
}

LoadedCheckpoint ZeroOptimizer::Impl::load_checkpoint(const std::string& path_in,
                                                      const CheckpointLoadOptions& options) {
  check_groups_fixed();
  // An asynchronous save still being written: its failure is reported through
  // the agreement below, so every rank raises together.
  std::string error = async_saver_.finish();
  LoadedCheckpoint result;
  result.path = checkpoint_path(path_in, "");
  const std::string& path = result.path;
  const bool with_state = options.load_optimizer_states();
  std::vector<std::array<at::Tensor, 5>> loaded(buffers_.size());
  std::vector<std::vector<int64_t>> steps(buffers_.size());
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> saved_options;
  bool same_grouping = false;  // the saved groups are this optimizer's
  std::string index_crc;
  std::vector<std::string> held;  // the saved names this rank's parameters matched
  std::vector<std::vector<const json*>> match(buffers_.size());
  // The data files, opened on first use.
  std::vector<std::optional<SafetensorsReader>> files;
  auto file = [&](size_t f) -> const SafetensorsReader& {
    if (!files[f]) {
      const std::string file_path = join(path, result.index.at("files")[f].at("name"));
      TORCH_CHECK_VALUE(fs::exists(file_path), "checkpoint file ", file_path,
                        " is missing (saved by rank ", f, " of ", result.index.at("world_size"),
                        ")");
      files[f].emplace(file_path);
    }
    return *files[f];
  };
  // Reads and verifies (CRC-32C) the pieces of `state` that hold group g's
  // segments on this rank, and hands each range to put(shard offset, values,
  // length); a segment never stepped has no state (zero, as a fresh one):
  // zero(shard offset, length). Returns whether any segment had the state.
  // One piece in memory at a time.
  auto visit_state = [&](size_t g, OptimizerStateName state, const auto& put,
                         const auto& zero) -> bool {
    bool any = false;
    for (const ShardSegment& segment : buffers_[g].segments) {
      const json& entry = *match[g][segment.param_index];
      const std::string& name = entry.at("name").get_ref<const std::string&>();
      const json& states = entry.at("states");
      if (!states.contains(optimizer_state_name(state))) {
        TORCH_CHECK_VALUE(state != OptimizerStateName::kMaster && entry.at("step") == 0,
                          "checkpoint ", path, " has no ", optimizer_state_name(state),
                          " for parameter '", name, "'");
        zero(segment.shard_offset, segment.numel);
        continue;
      }
      const int64_t begin = segment.param_offset, end = begin + segment.numel;
      // Both sides as unsplit elements (element_runs.h): equal to the
      // local ones without tensor parallelism.
      const size_t i = segment.param_index;
      const auto wanted_runs = checkpoint_detail::unsplit_runs(
          tensor_parallel_split(g, i), param_groups_[g].params()[i].sizes(), begin, segment.numel);
      int64_t covered = 0;
      for (const auto& piece : states.at(optimizer_state_name(state))) {
        const int64_t numel = piece.at("numel");
        checkpoint_detail::ElementRuns stored{piece.at("begin"), numel, numel, 1};
        if (piece.contains("run")) {
          stored.run = piece.at("run");
          stored.stride = piece.at("stride");
          TORCH_CHECK_VALUE(
              stored.run > 0 && numel % stored.run == 0 && stored.stride >= stored.run,
              "checkpoint ", path, " has an invalid piece of parameter '", name, "' (run ",
              stored.run, ", stride ", stored.stride, ", numel ", numel, ")");
          stored.count = numel / stored.run;
        }
        std::vector<std::array<int64_t, 3>> shared;
        checkpoint_detail::for_each_shared_range(wanted_runs, stored,
                                                 [&](int64_t to, int64_t from, int64_t length) {
                                                   shared.push_back({to, from, length});
                                                 });
        if (shared.empty()) {
          continue;
        }
        const size_t f = piece.at("file");
        const SafetensorsReader& reader = file(f);
        at::Tensor buffer = at::empty({numel}, at::kFloat);
        reader.read(piece.at("offset"), buffer.data_ptr(), numel * 4);
        TORCH_CHECK_VALUE(crc32c(buffer.data_ptr(), static_cast<size_t>(numel) * 4) ==
                              piece.at("crc32c").get<uint32_t>(),
                          "checksum mismatch in ", reader.path(), " for ",
                          optimizer_state_name(state), " of parameter '", name,
                          "' (the piece from element ", stored.begin, "): the file is corrupt");
        const float* source = buffer.data_ptr<float>();
        for (const auto& [to, from, length] : shared) {
          put(segment.shard_offset + to, source + from, length);
          covered += length;
        }
      }
      TORCH_CHECK_VALUE(covered == segment.numel, "checkpoint ", path, " covers ", covered,
                        " of elements ", begin, " to ", end, " of ", optimizer_state_name(state),
                        " of parameter '", name, "'");
      any = true;
    }
    return any;
  };
  // [Note: streaming load] With the optimizer state on NVMe the whole state
  // does not fit in host memory (that is why it is there): the pieces are
  // read and verified once before anything changes, holding nothing, and
  // read again after every rank agreed, each range written straight into
  // the swap space. Otherwise each state's new shard is assembled in host
  // memory from one pass.
  const bool streaming = offloaded_ && placement_->offload_tier() == StateTier::kNVMe;
  // Per group, the states the second pass writes (the master always).
  std::vector<std::vector<OptimizerStateName>> streamed(buffers_.size());
  try {
    TORCH_CHECK_VALUE(error.empty(), error);
    result.index = read_checkpoint_index(path);
    index_crc = std::to_string(crc32c(result.index.dump().data(), result.index.dump().size()));
    const json& index = result.index;
    TORCH_CHECK_VALUE(!with_state || index.at("inner_optimizer").get<std::string>() ==
                                         inner_optimizer_name(inner_kind_),
                      "checkpoint ", path, " holds the state of optimizer ",
                      index.at("inner_optimizer"), " but this optimizer is ",
                      inner_optimizer_name(inner_kind_),
                      "; load with load_optimizer_states=false to take its weights only");
    // Match this optimizer's parameters with the saved ones by name.
    std::unordered_map<std::string, const json*> saved;
    for (const auto& param : index.at("params")) {
      saved[param.at("name").get<std::string>()] = &param;
      for (const auto& alias : param.at("aliases")) {
        saved.emplace(alias.get<std::string>(), &param);
      }
    }
    std::vector<std::string> mismatches;
    int64_t mismatch_count = 0;
    std::unordered_map<const json*, bool> used;
    for (size_t g = 0; g < buffers_.size(); ++g) {
      for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
        const std::string name = parameter_name(g, i);
        // A tensor-parallel piece is matched by its unsplit shape.
        const std::vector<int64_t> shape = tensor_parallel_split(g, i).full_shape;
        auto it = saved.find(name);
        const json* entry = it == saved.end() ? nullptr : it->second;
        if (entry == nullptr) {
          ++mismatch_count;
          if (mismatches.size() < 5) {
            mismatches.push_back("'" + name + "' " + shape_string(at::IntArrayRef(shape)) +
                                 " is not in the checkpoint");
          }
        } else if (entry->at("shape").get<std::vector<int64_t>>() != shape) {
          ++mismatch_count;
          if (mismatches.size() < 5) {
            mismatches.push_back("'" + name + "' has shape " +
                                 shape_string(at::IntArrayRef(shape)) + " here but " +
                                 shape_string(entry->at("shape")) + " saved");
          }
        }
        used[entry] = true;
        match[g].push_back(entry);
        if (entry != nullptr) {
          held.push_back(entry->at("name").get<std::string>());  // its saved name, not an alias
        }
      }
    }
    for (const auto& param : index.at("params")) {
      // Under tensor/expert parallelism another rank may hold it (its
      // experts): checked over every rank once all have read the index.
      if (!used.count(&param) && !groups_->model_parallel()) {
        ++mismatch_count;
        if (mismatches.size() < 5) {
          mismatches.push_back("saved '" + param.at("name").get<std::string>() + "' " +
                               shape_string(param.at("shape")) + " is not in this model");
        }
      }
    }
    if (mismatch_count > 0) {
      std::ostringstream message;
      message << "checkpoint " << path << " is of another model: " << mismatch_count
              << " parameters differ by name or shape, first: ";
      for (size_t k = 0; k < mismatches.size(); ++k) {
        message << (k ? "; " : "") << mismatches[k];
      }
      TORCH_CHECK_VALUE(false, message.str());
    }

    // Read the ranges this rank owns now, piece by piece, checksums verified.
    files.resize(index.at("files").size());
    // Hyper-parameters follow the saved groups when the grouping is the same;
    // then they, not the current ones, say which states exist (amsgrad,
    // momentum). Applied only after every rank agreed.
    // (Every parameter of group g saved in group g: under expert parallelism
    // a saved group also lists the other ranks' experts.)
    const json& groups = index.at("groups");
    same_grouping = with_state && groups.size() == param_groups_.size();
    for (size_t g = 0; same_grouping && g < param_groups_.size(); ++g) {
      std::unordered_map<std::string, bool> saved_names;
      for (const auto& name : groups[g].at("params")) {
        saved_names[name.get<std::string>()] = true;
      }
      same_grouping = groups_->model_parallel()
                          ? saved_names.size() >= param_groups_[g].params().size()
                          : groups[g].at("params").size() == param_groups_[g].params().size();
      for (size_t i = 0; same_grouping && i < param_groups_[g].params().size(); ++i) {
        same_grouping = saved_names.count(parameter_name(g, i)) > 0;
      }
    }
    for (size_t g = 0; same_grouping && g < param_groups_.size(); ++g) {
      saved_options.push_back(param_groups_[g].options().clone());
      apply_inner_options_json(inner_kind_, *saved_options.back(), groups[g].at("hyperparameters"));
    }
    for (size_t g = 0; g < buffers_.size(); ++g) {
      const int64_t shard_numel = layout_->group(g).shard_numel();
      const torch::optim::OptimizerOptions& group_options =
          same_grouping ? *saved_options[g] : param_groups_[g].options();
      for (OptimizerStateName state : kAllOptimizerStates) {
        const bool wanted =
            state == OptimizerStateName::kMaster ||
            (with_state && inner_optimizer_uses_state(inner_kind_, group_options, state));
        if (!wanted) {
          continue;
        }
        if (streaming) {
          // The first pass: every piece read and verified, nothing kept.
          const bool any = visit_state(
              g, state, [](int64_t, const float*, int64_t) {}, [](int64_t, int64_t) {});
          if (any || state == OptimizerStateName::kMaster) {
            streamed[g].push_back(state);
          }
          continue;
        }
        at::Tensor values = at::zeros({shard_numel}, at::kFloat);
        float* target = values.data_ptr<float>();
        const bool any = visit_state(
            g, state,
            [&](int64_t offset, const float* source, int64_t length) {
              std::memcpy(target + offset, source, static_cast<size_t>(length) * sizeof(float));
            },
            [](int64_t, int64_t) {});  // already zeros
        if (any || state == OptimizerStateName::kMaster) {
          loaded[g][static_cast<size_t>(state)] = values;
        }
      }
      for (const json* entry : match[g]) {
        steps[g].push_back(entry->at("step").get<int64_t>());
      }
    }
    for (const auto& [name, record] : index.at("replicated_files").items()) {
      result.replicated_files[name] = verified_file(path, name, record);
    }
    // The writer that saved files under this rank's number: that rank, or,
    // for a later replica's rank, its first-replica counterpart (rank k of
    // replica r is number r x writers + k). Other numbers find none there.
    const auto saved_writers = static_cast<int64_t>(index.at("rank_files").size());
    if (saved_writers > 0) {
      const int64_t writer = checkpoint_rank() % saved_writers;
      for (const auto& [name, record] : index.at("rank_files")[writer].items()) {
        result.rank_files[name] = verified_file(path, name, record);
      }
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  // Replicas load the same files: an error on any rank of any group stops
  // every rank before anything changes.
  const std::string agreed = groups_->agree(error, "checkpoint_errors");
  TORCH_CHECK_VALUE(agreed.empty(), "could not load checkpoint ", path,
                    "; nothing was loaded on any rank ", agreed);
  // Every rank must have read the same checkpoint (a file system that is not
  // shared, or caches a replaced `latest`/index, would mix two).
  const auto crcs = groups_->all_gather_among_writers(index_crc, "checkpoint_index");
  TORCH_CHECK_VALUE(
      std::all_of(crcs.begin(), crcs.end(), [&](const auto& c) { return c == crcs[0]; }),
      "the ranks read different index.json files for checkpoint ", path,
      " (it must be on a file system every rank sees alike); nothing was loaded");

  if (groups_->model_parallel() && with_state) {
    // Under expert parallelism each rank matched its own experts against the
    // saved groups. Ranks that decided differently would take the
    // hyper-parameters (and which states exist) from different places.
    const auto verdicts =
        groups_->all_gather_among_writers(same_grouping ? "1" : "0", "checkpoint_grouping");
    const auto matching = std::count(verdicts.begin(), verdicts.end(), "1");
    TORCH_CHECK_VALUE(
        matching == 0 || matching == static_cast<int64_t>(verdicts.size()), "checkpoint ", path,
        ": its parameter groups match this optimizer's on ", matching, " of ", verdicts.size(),
        " ranks only (a group's parameters on one rank are in another saved group); group the "
        "parameters on every rank as they were grouped when saved; nothing was loaded");
  }
  if (groups_->model_parallel()) {
    // Every saved parameter must be held by some rank (the check the
    // matching above leaves to here): the same verdict on every rank, as
    // every rank read the same index.
    std::unordered_map<std::string, bool> anywhere;
    for (const std::string& each :
         groups_->all_gather_among_writers(nlohmann::json(held).dump(), "checkpoint_held")) {
      for (const auto& name : json::parse(each)) {
        anywhere[name.get<std::string>()] = true;
      }
    }
    std::vector<std::string> missing;
    for (const auto& param : result.index.at("params")) {
      if (!anywhere.count(param.at("name").get<std::string>())) {
        missing.push_back(param.at("name").get<std::string>());
      }
    }
    TORCH_CHECK_VALUE(missing.empty(), "checkpoint ", path,
                      " is of another model: ", missing.size(),
                      " saved parameters are held by no rank, first '",
                      missing.empty() ? "" : missing[0], "'; nothing was loaded");
  }

  at::NoGradGuard no_grad;
  if (streaming) {
    // The second pass (see [Note: streaming load]): what every rank verified
    // is read again and written range by range into the swap space. A read
    // or write failing now (the files changed since, the disk) is raised on
    // every rank; the state is then partly loaded, as the message says.
    std::string stream_error;
    try {
      for (size_t g = 0; g < buffers_.size(); ++g) {
        for (OptimizerStateName state : streamed[g]) {
          if (state != OptimizerStateName::kMaster && !with_state) {
            continue;
          }
          visit_state(
              g, state,
              [&](int64_t offset, const float* source, int64_t length) {
                offloaded_->write(g, state, offset,
                                  at::from_blob(const_cast<float*>(source), {length}, at::kFloat));
              },
              [&](int64_t offset, int64_t length) {
                offloaded_->write(g, state, offset, at::zeros({length}, at::kFloat));
              });
        }
        buffers_[g].steps = steps[g];
      }
    } catch (const std::exception& e) {
      stream_error = message_of(e);
    }
    const std::string agreed = groups_->agree(stream_error, "checkpoint_stream");
    TORCH_CHECK(agreed.empty(), "could not load checkpoint ", path,
                " into the NVMe swap space (the optimizer state is partly loaded; load it "
                "again): ",
                agreed);
  }
  for (size_t g = 0; g < buffers_.size() && !streaming; ++g) {
    write_master(g, 0, loaded[g][0].to(fp32_options()));
    if (!with_state) {
      continue;
    }
    for (size_t k = 1; k < kAllOptimizerStates.size(); ++k) {
      if (loaded[g][k].defined()) {
        storage().adopt(g, kAllOptimizerStates[k], loaded[g][k]);
      }
    }
    buffers_[g].steps = steps[g];
  }
  for (size_t g = 0; g < saved_options.size(); ++g) {
    param_groups_[g].set_options(std::move(saved_options[g]));
  }
  if (offloaded_) {
    refresh_parameters_from_master();
  }
  gather_parameters();
  return result;
}

}  // namespace zeroshard
