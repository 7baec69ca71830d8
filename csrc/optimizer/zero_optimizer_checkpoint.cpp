// ZeroOptimizer::save_checkpoint / load_checkpoint: the resharding checkpoint
// of checkpoint.h. See [Note: Checkpoint pieces] and docs/design.md.
#include "../checkpoint/durable_file.h"
#include "zeroshard/checkpoint.h"
#include "zeroshard/crc32c.h"
#include "zeroshard/safetensors.h"
#include "zeroshard/zero_optimizer.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <sstream>
#include <unordered_map>

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

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using checkpoint_detail::File;

constexpr std::array<OptimizerStateName, 5> kAllStates = {
    OptimizerStateName::kMaster, OptimizerStateName::kExpAvg, OptimizerStateName::kExpAvgSq,
    OptimizerStateName::kMaxExpAvgSq, OptimizerStateName::kMomentumBuffer};

const char* state_key(OptimizerStateName name) {
  switch (name) {
    case OptimizerStateName::kMaster:
      return "master";
    case OptimizerStateName::kExpAvg:
      return "exp_avg";
    case OptimizerStateName::kExpAvgSq:
      return "exp_avg_sq";
    case OptimizerStateName::kMaxExpAvgSq:
      return "max_exp_avg_sq";
    case OptimizerStateName::kMomentumBuffer:
      return "momentum_buffer";
  }
  return "?";
}

std::string rank_file_name(int64_t rank) {
  char name[64];
  std::snprintf(name, sizeof(name), "rank_%05lld.safetensors", static_cast<long long>(rank));
  return name;
}

std::string join(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

// Test hook for crash safety: ZEROSHARD_CHECKPOINT_FAULT="<rank>:<point>"
// kills that rank with SIGKILL when it reaches `point` (after_rank_file,
// before_publish, before_latest). Nothing else reads it.
void maybe_inject_fault(const char* point, int64_t rank) {
  const char* spec = std::getenv("ZEROSHARD_CHECKPOINT_FAULT");
  if (spec != nullptr && std::string(spec) == std::to_string(rank) + ":" + point) {
    std::fflush(stdout);
    std::raise(SIGKILL);
  }
}

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine,
                                            c10::Device device, const std::string& tag) {
  at::Tensor length = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong).to(device);
  comm.all_reduce_max(length, tag + "_length");
  const int64_t width = length.cpu().item<int64_t>() + 8;
  at::Tensor input = at::zeros({width}, at::kByte);
  const uint64_t size = mine.size();
  std::memcpy(input.data_ptr(), &size, 8);
  std::memcpy(static_cast<char*>(input.data_ptr()) + 8, mine.data(), mine.size());
  input = input.to(device);
  at::Tensor output = at::empty({width * comm.world_size()}, input.options());
  comm.all_gather(output, input, tag).wait();
  output = output.cpu();
  std::vector<std::string> all;
  const char* bytes = static_cast<const char*>(output.data_ptr());
  for (int64_t r = 0; r < comm.world_size(); ++r) {
    uint64_t n = 0;
    std::memcpy(&n, bytes + r * width, 8);
    all.emplace_back(bytes + r * width + 8, n);
  }
  return all;
}

// Every rank learns every rank's error: each raises the same message, naming
// the rank that failed and what it saw (the file, the parameter).
void agree_on_errors(Communicator& comm, const std::string& local_error, const std::string& what,
                     c10::Device device) {
  const auto errors = all_gather_strings(comm, local_error, device, "checkpoint_errors");
  std::ostringstream message;
  int64_t failed = 0;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) {
      ++failed;
    }
  }
  if (failed == static_cast<int64_t>(errors.size()) &&
      std::all_of(errors.begin(), errors.end(), [&](const auto& e) { return e == errors[0]; })) {
    message << "every rank: " << errors[0];
  } else {
    for (size_t r = 0, listed = 0; r < errors.size(); ++r) {
      if (!errors[r].empty()) {
        message << (listed++ == 0 ? "" : "; ") << "rank " << r << ": " << errors[r];
      }
    }
  }
  TORCH_CHECK_VALUE(failed == 0, "could not ", what, " (", failed, " of ", errors.size(),
                    " ranks failed): ", message.str());
}

json file_record(const std::string& content) {
  return {{"bytes", content.size()}, {"crc32c", crc32c(content.data(), content.size())}};
}

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

std::string shape_string(const json& shape) {
  const auto sizes = shape.get<std::vector<int64_t>>();
  std::ostringstream out;
  out << at::IntArrayRef(sizes);
  return out.str();
}

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
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
  TORCH_CHECK_VALUE(index.value("format_version", 0) == kCheckpointFormatVersion, index_path,
                    " has format version ", index.value("format_version", 0),
                    "; this build reads version ", kCheckpointFormatVersion);
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

void ZeroOptimizer::set_parameter_names(
    const std::vector<std::pair<std::string, at::Tensor>>& named) {
  param_names_.assign(param_groups_.size(), {});
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    param_names_[g].resize(param_groups_[g].params().size());
  }
  for (const auto& [name, tensor] : named) {
    auto it = param_index_.find(tensor.unsafeGetTensorImpl());
    if (it != param_index_.end()) {
      param_names_[it->second.first][it->second.second].push_back(name);
    }
  }
}

std::string ZeroOptimizer::parameter_name(size_t group, size_t index) const {
  if (group < param_names_.size() && !param_names_[group][index].empty()) {
    return param_names_[group][index].front();
  }
  return "group" + std::to_string(group) + "." + std::to_string(index);
}

std::vector<std::string> ZeroOptimizer::parameter_aliases(size_t group, size_t index) const {
  if (group < param_names_.size() && param_names_[group][index].size() > 1) {
    return {param_names_[group][index].begin() + 1, param_names_[group][index].end()};
  }
  return {};
}

bool ZeroOptimizer::has_state(size_t g, OptimizerStateName name) const {
  if (name == OptimizerStateName::kMaster) {
    return true;
  }
  if (offloaded_) {
    return offloaded_->has(g, name);
  }
  const GroupShards& shard = shards_[g];
  const at::Tensor* tensors[] = {nullptr, &shard.exp_avg, &shard.exp_avg_sq, &shard.max_exp_avg_sq,
                                 &shard.momentum_buffer};
  return tensors[static_cast<size_t>(name)]->defined();
}

at::Tensor ZeroOptimizer::read_state(size_t g, OptimizerStateName name, int64_t offset,
                                     int64_t length) const {
  if (name == OptimizerStateName::kMaster) {
    return read_master(g, offset, length);
  }
  if (offloaded_) {
    return offloaded_->read(g, name, offset, length, fp32_options().device(c10::kCPU));
  }
  const GroupShards& shard = shards_[g];
  const at::Tensor* tensors[] = {nullptr, &shard.exp_avg, &shard.exp_avg_sq, &shard.max_exp_avg_sq,
                                 &shard.momentum_buffer};
  return tensors[static_cast<size_t>(name)]->narrow(0, offset, length);
}

void ZeroOptimizer::save_checkpoint(const std::string& path_in,
                                    const CheckpointSaveOptions& options) {
  const std::string path = checkpoint_path(path_in, "");
  const std::string staging = path + ".tmp";
  const int64_t rank = comm_->rank();
  std::string error;
  if (rank == 0) {
    try {
      fs::remove_all(staging);  // what an interrupted save left
      fs::create_directories(staging);
    } catch (const std::exception& e) {
      error = "cannot create " + staging + ": " + message_of(e);
    }
  }
  agree_on_errors(*comm_, error, "prepare checkpoint directory " + staging, device());

  // This rank's data file: every owned segment of every state.
  json manifest = {{"file", rank_file_name(rank)}, {"pieces", json::array()}};
  try {
    at::NoGradGuard no_grad;
    std::vector<SafetensorsEntry> entries;
    struct Source {
      size_t group;
      OptimizerStateName state;
      ShardSegment segment;
    };
    std::vector<Source> sources;
    for (size_t g = 0; g < shards_.size(); ++g) {
      for (const ShardSegment& segment : shards_[g].segments) {
        for (OptimizerStateName state : kAllStates) {
          if (!has_state(g, state)) {
            continue;
          }
          entries.push_back({std::string(state_key(state)) + "/" +
                                 parameter_name(g, segment.param_index) + "/" +
                                 std::to_string(segment.param_offset),
                             at::kFloat,
                             {segment.numel}});
          sources.push_back({g, state, segment});
        }
      }
    }
    SafetensorsWriter writer(join(staging, rank_file_name(rank)), std::move(entries),
                             {{"format", "zeroshard-checkpoint"},
                              {"rank", std::to_string(rank)},
                              {"world_size", std::to_string(comm_->world_size())}});
    for (const Source& source : sources) {
      const WrittenPiece piece = writer.append(read_state(
          source.group, source.state, source.segment.shard_offset, source.segment.numel));
      manifest["pieces"].push_back({parameter_name(source.group, source.segment.param_index),
                                    state_key(source.state), source.segment.param_offset,
                                    source.segment.numel, piece.offset, piece.crc32c});
    }
    writer.finish();
    manifest["bytes"] = writer.bytes_written();
    manifest["rank_files"] = json::object();
    for (const auto& [name, content] : options.rank_files()) {
      checkpoint_detail::write_file_synced(join(staging, name), content);
      manifest["rank_files"][name] = file_record(content);
    }
    maybe_inject_fault("after_rank_file", rank);
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  agree_on_errors(*comm_, error, "write checkpoint " + path, device());
  const auto manifests =
      all_gather_strings(*comm_, manifest.dump(), device(), "checkpoint_manifest");

  if (rank == 0) {
    try {
      json index = {{"format", "zeroshard-checkpoint"},
                    {"format_version", kCheckpointFormatVersion},
                    {"zeroshard_version", "0.1.0"},
                    {"world_size", comm_->world_size()},
                    {"stage", options_.stage()},
                    {"inner_optimizer", inner_optimizer_name(inner_kind_)},
                    {"offload_optimizer", options_.offload_optimizer().enabled() ? "cpu" : "none"},
                    {"reduce_bucket_size", options_.reduce_bucket_size()},
                    {"files", json::array()},
                    {"groups", json::array()},
                    {"params", json::array()},
                    {"replicated", options.replicated()},
                    {"replicated_files", json::object()},
                    {"rank_files", json::array()}};
      std::unordered_map<std::string, size_t> position;  // name -> index in "params"
      for (size_t g = 0; g < param_groups_.size(); ++g) {
        json group = {
            {"hyperparameters", inner_options_to_json(inner_kind_, param_groups_[g].options())},
            {"params", json::array()}};
        for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
          const at::Tensor& param = param_groups_[g].params()[i];
          const std::string name = parameter_name(g, i);
          group["params"].push_back(name);
          position[name] = index["params"].size();
          index["params"].push_back({{"name", name},
                                     {"aliases", parameter_aliases(g, i)},
                                     {"shape", param.sizes().vec()},
                                     {"dtype", safetensors_dtype_name(param.scalar_type())},
                                     {"group", g},
                                     {"step", shards_[g].steps[i]},
                                     {"states", json::object()}});
        }
        index["groups"].push_back(std::move(group));
      }
      for (size_t r = 0; r < manifests.size(); ++r) {
        const json theirs = json::parse(manifests[r]);
        index["files"].push_back({{"name", theirs.at("file")}, {"bytes", theirs.at("bytes")}});
        index["rank_files"].push_back(theirs.at("rank_files"));
        for (const auto& piece : theirs.at("pieces")) {
          json& states = index["params"][position.at(piece[0].get<std::string>())]["states"];
          states[piece[1].get<std::string>()].push_back({{"file", r},
                                                         {"begin", piece[2]},
                                                         {"numel", piece[3]},
                                                         {"offset", piece[4]},
                                                         {"crc32c", piece[5]}});
        }
      }
      for (const auto& [name, content] : options.replicated_files()) {
        checkpoint_detail::write_file_synced(join(staging, name), content);
        index["replicated_files"][name] = file_record(content);
      }
      checkpoint_detail::write_file_synced(join(staging, kCheckpointIndexFile), index.dump(1));
      checkpoint_detail::fsync_directory(staging);
      maybe_inject_fault("before_publish", rank);
      checkpoint_detail::publish_directory(staging, path);
      maybe_inject_fault("before_latest", rank);
      if (!options.latest_path().empty()) {
        checkpoint_detail::replace_file_atomically(options.latest_path(), options.latest_tag());
      }
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  agree_on_errors(*comm_, error, "commit checkpoint " + path, device());
}

LoadedCheckpoint ZeroOptimizer::load_checkpoint(const std::string& path_in,
                                                const CheckpointLoadOptions& options) {
  LoadedCheckpoint result;
  result.path = checkpoint_path(path_in, "");
  const std::string& path = result.path;
  const bool with_state = options.load_optimizer_states();
  std::vector<std::array<at::Tensor, 5>> loaded(shards_.size());
  std::vector<std::vector<int64_t>> steps(shards_.size());
  std::string error;
  try {
    result.index = read_checkpoint_index(path);
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
    std::vector<std::vector<const json*>> match(shards_.size());
    std::vector<std::string> mismatches;
    int64_t mismatch_count = 0;
    std::unordered_map<const json*, bool> used;
    for (size_t g = 0; g < shards_.size(); ++g) {
      for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
        const std::string name = parameter_name(g, i);
        const at::Tensor& param = param_groups_[g].params()[i];
        auto it = saved.find(name);
        const json* entry = it == saved.end() ? nullptr : it->second;
        if (entry == nullptr) {
          ++mismatch_count;
          if (mismatches.size() < 5) {
            mismatches.push_back("'" + name + "' " + shape_string(param.sizes()) +
                                 " is not in the checkpoint");
          }
        } else if (entry->at("shape").get<std::vector<int64_t>>() != param.sizes().vec()) {
          ++mismatch_count;
          if (mismatches.size() < 5) {
            mismatches.push_back("'" + name + "' has shape " + shape_string(param.sizes()) +
                                 " here but " + shape_string(entry->at("shape")) + " saved");
          }
        }
        used[entry] = true;
        match[g].push_back(entry);
      }
    }
    for (const auto& param : index.at("params")) {
      if (!used.count(&param)) {
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
    std::vector<std::optional<SafetensorsReader>> files(index.at("files").size());
    auto file = [&](size_t f) -> const SafetensorsReader& {
      if (!files[f]) {
        const std::string file_path = join(path, index.at("files")[f].at("name"));
        TORCH_CHECK_VALUE(fs::exists(file_path), "checkpoint file ", file_path,
                          " is missing (saved by rank ", f, " of ", index.at("world_size"), ")");
        files[f].emplace(file_path);
      }
      return *files[f];
    };
    for (size_t g = 0; g < shards_.size(); ++g) {
      const int64_t shard_numel = layout_->group(g).shard_numel();
      for (OptimizerStateName state : kAllStates) {
        const bool wanted =
            state == OptimizerStateName::kMaster ||
            (with_state && inner_optimizer_uses_state(inner_kind_, param_groups_[g].options(),
                                                      static_cast<int>(state)));
        if (!wanted) {
          continue;
        }
        at::Tensor values = at::zeros({shard_numel}, at::kFloat);
        bool any = false;
        for (const ShardSegment& segment : shards_[g].segments) {
          const json& entry = *match[g][segment.param_index];
          const std::string& name = entry.at("name").get_ref<const std::string&>();
          const json& states = entry.at("states");
          if (!states.contains(state_key(state))) {
            TORCH_CHECK_VALUE(state != OptimizerStateName::kMaster && entry.at("step") == 0,
                              "checkpoint ", path, " has no ", state_key(state), " for parameter '",
                              name, "'");
            continue;  // never stepped: the state is zero, as a fresh one
          }
          const int64_t begin = segment.param_offset, end = begin + segment.numel;
          int64_t covered = 0;
          for (const auto& piece : states.at(state_key(state))) {
            const int64_t piece_begin = piece.at("begin"), numel = piece.at("numel");
            const int64_t lo = std::max(begin, piece_begin);
            const int64_t hi = std::min(end, piece_begin + numel);
            if (lo >= hi) {
              continue;
            }
            const size_t f = piece.at("file");
            const SafetensorsReader& reader = file(f);
            at::Tensor buffer = at::empty({numel}, at::kFloat);
            reader.read(piece.at("offset"), buffer.data_ptr(), numel * 4);
            TORCH_CHECK_VALUE(crc32c(buffer.data_ptr(), static_cast<size_t>(numel) * 4) ==
                                  piece.at("crc32c").get<uint32_t>(),
                              "checksum mismatch in ", reader.path(), " for ", state_key(state),
                              " of parameter '", name, "' (elements ", piece_begin, " to ",
                              piece_begin + numel, "): the file is corrupt");
            values.narrow(0, segment.shard_offset + lo - begin, hi - lo)
                .copy_(buffer.narrow(0, lo - piece_begin, hi - lo));
            covered += hi - lo;
          }
          TORCH_CHECK_VALUE(covered == segment.numel, "checkpoint ", path, " covers ", covered,
                            " of elements ", begin, " to ", end, " of ", state_key(state),
                            " of parameter '", name, "'");
          any = true;
        }
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
    if (comm_->rank() < static_cast<int64_t>(index.at("rank_files").size())) {
      for (const auto& [name, record] : index.at("rank_files")[comm_->rank()].items()) {
        result.rank_files[name] = verified_file(path, name, record);
      }
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  agree_on_errors(*comm_, error, "load checkpoint " + path + "; nothing was loaded on any rank",
                  device());

  at::NoGradGuard no_grad;
  for (size_t g = 0; g < shards_.size(); ++g) {
    GroupShards& shard = shards_[g];
    write_master(g, 0, loaded[g][0].to(fp32_options()));
    if (!with_state) {
      continue;
    }
    at::Tensor* tensors[] = {nullptr, &shard.exp_avg, &shard.exp_avg_sq, &shard.max_exp_avg_sq,
                             &shard.momentum_buffer};
    for (size_t k = 1; k < kAllStates.size(); ++k) {
      const at::Tensor& values = loaded[g][k];
      if (!values.defined()) {
        continue;
      }
      if (offloaded_) {
        offloaded_->write(g, kAllStates[k], 0, values);
      } else if (tensors[k]->defined()) {
        tensors[k]->copy_(values);
      } else {
        *tensors[k] = values.to(fp32_options());
      }
    }
    shard.steps = steps[g];
  }
  if (with_state) {
    // Hyper-parameters follow the saved groups when the grouping is the same.
    const json& groups = result.index.at("groups");
    bool same_grouping = groups.size() == param_groups_.size();
    for (size_t g = 0; same_grouping && g < param_groups_.size(); ++g) {
      same_grouping = groups[g].at("params").size() == param_groups_[g].params().size();
      for (size_t i = 0; same_grouping && i < param_groups_[g].params().size(); ++i) {
        same_grouping = groups[g].at("params")[i].get<std::string>() == parameter_name(g, i);
      }
    }
    for (size_t g = 0; same_grouping && g < param_groups_.size(); ++g) {
      apply_inner_options_json(inner_kind_, param_groups_[g].options(),
                               groups[g].at("hyperparameters"));
    }
  }
  if (offloaded_) {
    refresh_parameters_from_master();
  }
  gather_parameters();
  return result;
}

}  // namespace zeroshard
