// zeroshard checkpoints: one directory per checkpoint, resumable at any world
// size, stage, bucket size, offload setting or grouping of the parameters.
// See docs/design.md ("Checkpoints") for the format and the commit protocol.
//
//   <dir>/index.json              every parameter's name, shape, dtype, step
//                                 and, per state, its pieces (file, byte
//                                 offset, element range, CRC-32C); replicated
//                                 state (engine counters, loss scaler, ...)
//   <dir>/rank_00000.safetensors  rank 0's pieces: "<state>/<name>/<begin>"
//   <dir>/<extra files>           e.g. client_state.pt, rng_state_0.pt
//
// Writing is atomic: ranks write into <dir>.tmp/ and fsync, agree that every
// write succeeded, and rank 0 writes the index and renames the directory into
// place (exchanging it atomically with an older one of the same name).
#pragma once

#include <torch/csrc/api/include/torch/arg.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>

namespace zeroshard {

// Version 2 added strided pieces (tensor parallelism); version 1 still loads.
constexpr int64_t kCheckpointFormatVersion = 2;
constexpr const char* kCheckpointIndexFile = "index.json";

using CheckpointFiles = std::map<std::string, std::string>;  // file name -> bytes

struct CheckpointSaveOptions {
  // Stored once, in the index's "replicated" entry (the engine's counters,
  // loss scaler and schedule position; what a caller wants to keep).
  TORCH_ARG(nlohmann::json, replicated) = nlohmann::json::object();
  // Small files rank 0 writes into the checkpoint (e.g. a pickled client_state).
  TORCH_ARG(CheckpointFiles, replicated_files);
  // Small files this rank writes; names must differ between ranks (e.g.
  // rng_state_<rank>.pt).
  TORCH_ARG(CheckpointFiles, rank_files);
  // When set, after the commit rank 0 replaces this file (DeepSpeed's
  // `latest`) atomically by latest_tag.
  TORCH_ARG(std::string, latest_path);
  TORCH_ARG(std::string, latest_tag);
  // Copy the state into host memory (pinned on CUDA) during the call and
  // write and commit it from a background thread while training goes on. The
  // next save or load, wait_for_checkpoint() or the optimizer's destruction
  // waits for it. The ranks agree on the commit through the c10d store.
  TORCH_ARG(bool, async_save) = false;
};

struct CheckpointLoadOptions {
  // Moments, step counts and hyper-parameters; false loads the weights only
  // (into the master and the parameters) and leaves the optimizer state as is.
  TORCH_ARG(bool, load_optimizer_states) = true;
};

// What a load read besides the shards: the index (whose "replicated" entry
// holds what the saver stored), and the extra files, checksums verified.
struct LoadedCheckpoint {
  std::string path;
  nlohmann::json index;
  CheckpointFiles replicated_files;
  // The files saved by the rank with this rank's number (empty when the saving
  // run had fewer ranks).
  CheckpointFiles rank_files;
};

// Reads and checks <path>/index.json; errors name the path.
nlohmann::json read_checkpoint_index(const std::string& path);
// The tag DeepSpeed's `latest` file in `dir` names; throws naming the file
// when there is none.
std::string read_latest_tag(const std::string& dir);
// "<dir>/<tag>" with the separators normalized.
std::string checkpoint_path(const std::string& dir, const std::string& tag);

}  // namespace zeroshard
