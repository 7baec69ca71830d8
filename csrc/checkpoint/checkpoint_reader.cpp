#include "checkpoint_reader.h"

#include "checkpoint_detail.h"
#include "durable_file.h"
#include "element_runs.h"
#include "zeroshard/checkpoint.h"
#include "zeroshard/crc32c.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <array>
#include <filesystem>
#include <sstream>
#include <unordered_map>
#include <utility>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using checkpoint_detail::join;

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

CheckpointReader::CheckpointReader(std::string path)
    : path_(std::move(path)), index_(read_checkpoint_index(path_)) {
  files_.resize(index_.at("files").size());
}

void CheckpointReader::match(std::vector<std::vector<Parameter>> groups, bool others_may_hold) {
  params_ = std::move(groups);
  std::unordered_map<std::string, const json*> saved;
  for (const auto& param : index_.at("params")) {
    saved[param.at("name").get<std::string>()] = &param;
    for (const auto& alias : param.at("aliases")) {
      saved.emplace(alias.get<std::string>(), &param);
    }
  }
  std::vector<std::string> mismatches;
  int64_t mismatch_count = 0;
  auto mismatch = [&](std::string what) {
    ++mismatch_count;
    if (mismatches.size() < 5) {
      mismatches.push_back(std::move(what));
    }
  };
  std::unordered_map<const json*, bool> used;
  match_.assign(params_.size(), {});
  held_.clear();
  for (size_t g = 0; g < params_.size(); ++g) {
    for (const Parameter& param : params_[g]) {
      // A tensor-parallel piece is matched by its unsplit shape.
      const std::vector<int64_t>& shape = param.split.full_shape;
      auto it = saved.find(param.name);
      const json* entry = it == saved.end() ? nullptr : it->second;
      if (entry == nullptr) {
        mismatch("'" + param.name + "' " + shape_string(at::IntArrayRef(shape)) +
                 " is not in the checkpoint");
      } else if (entry->at("shape").get<std::vector<int64_t>>() != shape) {
        mismatch("'" + param.name + "' has shape " + shape_string(at::IntArrayRef(shape)) +
                 " here but " + shape_string(entry->at("shape")) + " saved");
      }
      used[entry] = true;
      match_[g].push_back(entry);
      if (entry != nullptr) {
        held_.push_back(entry->at("name").get<std::string>());  // its saved name, not an alias
      }
    }
  }
  for (const auto& param : index_.at("params")) {
    if (!used.count(&param) && !others_may_hold) {
      mismatch("saved '" + param.at("name").get<std::string>() + "' " +
               shape_string(param.at("shape")) + " is not in this model");
    }
  }
  if (mismatch_count > 0) {
    std::ostringstream message;
    message << "checkpoint " << path_ << " is of another model: " << mismatch_count
            << " parameters differ by name or shape, first: ";
    for (size_t k = 0; k < mismatches.size(); ++k) {
      message << (k ? "; " : "") << mismatches[k];
    }
    TORCH_CHECK_VALUE(false, message.str());
  }
}

std::vector<int64_t> CheckpointReader::saved_steps(size_t group) const {
  std::vector<int64_t> steps;
  for (const json* entry : match_[group]) {
    steps.push_back(entry->at("step").get<int64_t>());
  }
  return steps;
}

bool CheckpointReader::same_grouping(bool others_may_hold) const {
  // Every parameter of group g saved in group g: under expert parallelism a
  // saved group also lists the other ranks' experts.
  const json& groups = index_.at("groups");
  if (groups.size() != params_.size()) {
    return false;
  }
  for (size_t g = 0; g < params_.size(); ++g) {
    std::unordered_map<std::string, bool> saved_names;
    for (const auto& name : groups[g].at("params")) {
      saved_names[name.get<std::string>()] = true;
    }
    const bool sizes_fit = others_may_hold ? saved_names.size() >= params_[g].size()
                                           : groups[g].at("params").size() == params_[g].size();
    if (!sizes_fit) {
      return false;
    }
    for (const Parameter& param : params_[g]) {
      if (saved_names.count(param.name) == 0) {
        return false;
      }
    }
  }
  return true;
}

std::string CheckpointReader::read_verified_file(const std::string& name,
                                                 const json& record) const {
  const std::string file_path = checkpoint_detail::join(path_, name);
  TORCH_CHECK_VALUE(fs::exists(file_path), "checkpoint file ", file_path, " is missing");
  std::string content = checkpoint_detail::read_whole_file(file_path);
  TORCH_CHECK_VALUE(
      content.size() == record.at("bytes").get<size_t>() &&
          crc32c(content.data(), content.size()) == record.at("crc32c").get<uint32_t>(),
      "checkpoint file ", file_path, " is corrupt (size or CRC-32C differs from ",
      kCheckpointIndexFile, ")");
  return content;
}

const SafetensorsReader& CheckpointReader::file(size_t f) {
  if (!files_[f]) {
    const std::string file_path = checkpoint_detail::join(path_, index_.at("files")[f].at("name"));
    TORCH_CHECK_VALUE(fs::exists(file_path), "checkpoint file ", file_path,
                      " is missing (saved by rank ", f, " of ", index_.at("world_size"), ")");
    files_[f].emplace(file_path);
  }
  return *files_[f];
}

bool CheckpointReader::visit_state(size_t g, const std::vector<ShardSegment>& segments,
                                   OptimizerStateName state, const Put& put, const Zero& zero) {
  bool any = false;
  for (const ShardSegment& segment : segments) {
    const json& entry = *match_[g][segment.param_index];
    const std::string& name = entry.at("name").get_ref<const std::string&>();
    const json& states = entry.at("states");
    if (!states.contains(optimizer_state_name(state))) {
      TORCH_CHECK_VALUE(state != OptimizerStateName::kMaster && entry.at("step") == 0,
                        "checkpoint ", path_, " has no ", optimizer_state_name(state),
                        " for parameter '", name, "'");
      zero(segment.shard_offset, segment.numel);
      continue;
    }
    const int64_t begin = segment.param_offset, end = begin + segment.numel;
    // Both sides as unsplit elements (element_runs.h): equal to the local
    // ones without tensor parallelism.
    const Parameter& param = params_[g][segment.param_index];
    const auto wanted_runs =
        checkpoint_detail::unsplit_runs(param.split, param.local_shape, begin, segment.numel);
    int64_t covered = 0;
    for (const auto& piece : states.at(optimizer_state_name(state))) {
      const int64_t numel = piece.at("numel");
      checkpoint_detail::ElementRuns stored{piece.at("begin"), numel, numel, 1};
      if (piece.contains("run")) {
        stored.run = piece.at("run");
        stored.stride = piece.at("stride");
        TORCH_CHECK_VALUE(stored.run > 0 && numel % stored.run == 0 && stored.stride >= stored.run,
                          "checkpoint ", path_, " has an invalid piece of parameter '", name,
                          "' (run ", stored.run, ", stride ", stored.stride, ", numel ", numel,
                          ")");
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
      const SafetensorsReader& reader = file(piece.at("file"));
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
    TORCH_CHECK_VALUE(covered == segment.numel, "checkpoint ", path_, " covers ", covered,
                      " of elements ", begin, " to ", end, " of ", optimizer_state_name(state),
                      " of parameter '", name, "'");
    any = true;
  }
  return any;
}

}  // namespace zeroshard
