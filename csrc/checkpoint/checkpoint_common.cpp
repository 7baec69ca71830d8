#include "checkpoint_detail.h"

#include "durable_file.h"
#include "zeroshard/crc32c.h"
#include "zeroshard/safetensors.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <unordered_map>

namespace zeroshard::checkpoint_detail {

using json = nlohmann::json;

std::string rank_file_name(int64_t rank) {
  char name[64];
  std::snprintf(name, sizeof(name), "rank_%05lld.safetensors", static_cast<long long>(rank));
  return name;
}

std::string join(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).string();
}

std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

void maybe_inject_fault(const char* point, int64_t rank) {
  const char* spec = std::getenv("ZEROSHARD_CHECKPOINT_FAULT");
  if (spec != nullptr && std::string(spec) == std::to_string(rank) + ":" + point) {
    std::fflush(stdout);
    std::raise(SIGKILL);
  }
}

json file_record(const std::string& content) {
  return {{"bytes", content.size()}, {"crc32c", crc32c(content.data(), content.size())}};
}

json write_rank_file(const std::string& dir, int64_t rank, int64_t world_size,
                     const std::vector<PieceSpec>& pieces,
                     const std::function<at::Tensor(size_t)>& piece,
                     const CheckpointFiles& rank_files) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(pieces.size());
  for (const PieceSpec& spec : pieces) {
    entries.push_back({spec.state + "/" + spec.param + "/" + std::to_string(spec.begin),
                       at::kFloat,
                       {spec.numel}});
  }
  json manifest = {{"file", rank_file_name(rank)}, {"pieces", json::array()}};
  SafetensorsWriter writer(join(dir, rank_file_name(rank)), std::move(entries),
                           {{"format", "zeroshard-checkpoint"},
                            {"rank", std::to_string(rank)},
                            {"world_size", std::to_string(world_size)}});
  for (size_t i = 0; i < pieces.size(); ++i) {
    const WrittenPiece written = writer.append(piece(i));
    json record = {pieces[i].param, pieces[i].state, pieces[i].begin,
                   pieces[i].numel, written.offset,  written.crc32c};
    if (pieces[i].run > 0) {
      record.push_back(pieces[i].run);
      record.push_back(pieces[i].stride);
    }
    manifest["pieces"].push_back(std::move(record));
  }
  writer.finish();
  manifest["bytes"] = writer.bytes_written();
  manifest["rank_files"] = json::object();
  for (const auto& [name, content] : rank_files) {
    write_file_synced(join(dir, name), content);
    manifest["rank_files"][name] = file_record(content);
  }
  return manifest;
}

void merge_manifests(json& index, const std::vector<std::string>& manifests) {
  std::unordered_map<std::string, size_t> position;  // name -> index in "params"
  for (size_t i = 0; i < index["params"].size(); ++i) {
    position[index["params"][i]["name"].get<std::string>()] = i;
  }
  for (size_t r = 0; r < manifests.size(); ++r) {
    const json theirs = json::parse(manifests[r]);
    // Parameters rank 0 does not hold (another expert-parallel rank's
    // experts) join the index and their group's list.
    for (const auto& param : theirs.value("params", json::array())) {
      const std::string& name = param.at("name").get_ref<const std::string&>();
      if (position.emplace(name, index["params"].size()).second) {
        index["params"].push_back(param);
        index["groups"][param.at("group").get<size_t>()]["params"].push_back(name);
      }
    }
    index["files"].push_back({{"name", theirs.at("file")}, {"bytes", theirs.at("bytes")}});
    index["rank_files"].push_back(theirs.at("rank_files"));
    for (const auto& piece : theirs.at("pieces")) {
      const std::string& name = piece[0].get_ref<const std::string&>();
      auto found = position.find(name);
      TORCH_CHECK_VALUE(found != position.end(), "rank ", r, " stored parameter '", name,
                        "', which rank 0 does not have: every rank of the shard and "
                        "tensor-parallel groups must name the same parameters");
      json& states = index["params"][found->second]["states"];
      json record = {{"file", r},
                     {"begin", piece[2]},
                     {"numel", piece[3]},
                     {"offset", piece[4]},
                     {"crc32c", piece[5]}};
      if (piece.size() > 6) {
        record["run"] = piece[6];
        record["stride"] = piece[7];
      }
      states[piece[1].get<std::string>()].push_back(std::move(record));
    }
  }
  // Each element once: two ranks storing a tensor under one name (experts of
  // two expert-parallel ranks both called "experts.0...") would make the
  // checkpoint unreadable.
  for (const auto& param : index["params"]) {
    for (const auto& [state, pieces] : param["states"].items()) {
      // A state of a shape of its own ([Note: parameter states] in
      // update_rule.h), or one element per parameter element.
      const json& shape = param.contains("state_shapes") && param["state_shapes"].contains(state)
                              ? param["state_shapes"][state]
                              : param["shape"];
      int64_t numel = 1;
      for (const auto& extent : shape) {
        numel *= extent.get<int64_t>();
      }
      int64_t stored = 0;
      for (const auto& piece : pieces) {
        stored += piece["numel"].get<int64_t>();
      }
      TORCH_CHECK_VALUE(stored == numel, "the ranks stored ", stored, " elements of ", state,
                        " for parameter '", param["name"].get<std::string>(), "' of ", numel,
                        ": a name must stand for one tensor on every rank (experts held by "
                        "different expert-parallel ranks need names of their own)");
    }
  }
}

void publish(const json& index_in, const std::string& staging, const std::string& path,
             const CheckpointSaveOptions& options) {
  json index = index_in;
  for (const auto& [name, content] : options.replicated_files()) {
    write_file_synced(join(staging, name), content);
    index["replicated_files"][name] = file_record(content);
  }
  write_file_synced(join(staging, kCheckpointIndexFile), index.dump(1));
  fsync_directory(staging);
  maybe_inject_fault("before_publish", 0);
  publish_directory(staging, path);
  maybe_inject_fault("before_latest", 0);
  if (!options.latest_path().empty()) {
    replace_file_atomically(options.latest_path(), options.latest_tag());
  }
}

std::string encode_files(const CheckpointFiles& files) {
  std::string out;
  auto append = [&out](const std::string& text) {
    const uint64_t size = text.size();
    out.append(reinterpret_cast<const char*>(&size), sizeof(size));
    out.append(text);
  };
  for (const auto& [name, content] : files) {
    append(name);
    append(content);
  }
  return out;
}

CheckpointFiles decode_files(const std::string& bytes) {
  CheckpointFiles files;
  size_t at = 0;
  auto next = [&]() {
    uint64_t size = 0;
    TORCH_CHECK(at + sizeof(size) <= bytes.size(), "decode_files: truncated input");
    std::memcpy(&size, bytes.data() + at, sizeof(size));
    at += sizeof(size);
    TORCH_CHECK(at + size <= bytes.size(), "decode_files: truncated input");
    std::string text = bytes.substr(at, size);
    at += size;
    return text;
  };
  while (at < bytes.size()) {
    std::string name = next();
    files[name] = next();
  }
  return files;
}

namespace {
// A rank lost mid-save must not leave the others waiting forever.
constexpr auto kCommitTimeout = std::chrono::minutes(30);

std::string wait_for_outcome(c10d::Store* store, const std::string& key) {
  // Longer than rank 0's own wait, which always ends with an outcome.
  store->wait({key + "/outcome"}, 2 * kCommitTimeout);
  const std::string outcome = store->get_to_str(key + "/outcome");
  return outcome == "ok" ? "" : outcome;
}
}  // namespace

std::string await_commit_outcome(c10d::Store* store, const std::string& key) {
  try {
    return wait_for_outcome(store, key);
  } catch (const std::exception& e) {
    return "(the ranks could not agree through the store: " + message_of(e) + ")";
  }
}

std::string commit_through_store(c10d::Store* store, const std::string& key, int64_t rank,
                                 int64_t world_size, const std::string& local_error,
                                 const json& manifest, json index, const std::string& staging,
                                 const std::string& path, const CheckpointSaveOptions& options) {
  constexpr auto kTimeout = kCommitTimeout;
  auto publish_on_rank0 = [&](const std::vector<std::string>& manifests) -> std::string {
    try {
      merge_manifests(index, manifests);
      publish(index, staging, path, options);
      return "";
    } catch (const std::exception& e) {
      return combined_error({message_of(e)});
    }
  };
  if (world_size == 1) {
    const std::string outcome =
        local_error.empty() ? publish_on_rank0({manifest.dump()}) : combined_error({local_error});
    if (store != nullptr) {
      try {
        // Replicas of a one-rank shard group wait for it (hybrid sharding).
        store->set(key + "/outcome", outcome.empty() ? "ok" : outcome);
      } catch (const std::exception&) {  // they time out with the store's own error
      }
    }
    return outcome;
  }
  try {
    store->set(key + "/rank" + std::to_string(rank),
               local_error.empty() ? "ok" + manifest.dump() : "error" + local_error);
    if (rank != 0) {
      return wait_for_outcome(store, key);
    }
    std::vector<std::string> keys;
    for (int64_t r = 0; r < world_size; ++r) {
      keys.push_back(key + "/rank" + std::to_string(r));
    }
    store->wait(keys, kTimeout);
    std::vector<std::string> errors, manifests;
    for (const auto& k : keys) {
      const std::string value = store->get_to_str(k);
      const bool ok = value.rfind("ok", 0) == 0;
      errors.push_back(ok ? "" : value.substr(5));
      manifests.push_back(ok ? value.substr(2) : "");
    }
    std::string outcome = combined_error(errors);
    if (outcome.empty()) {
      outcome = publish_on_rank0(manifests);
    }
    store->set(key + "/outcome", outcome.empty() ? "ok" : outcome);
    return outcome;
  } catch (const std::exception& e) {
    const std::string outcome =
        "(the ranks could not agree through the store: " + message_of(e) + ")";
    if (rank == 0) {
      try {
        store->set(key + "/outcome", outcome);  // the others stop waiting too
      } catch (const std::exception&) {         // the store itself is gone: they time out
      }
    }
    return outcome;
  }
}

}  // namespace zeroshard::checkpoint_detail
