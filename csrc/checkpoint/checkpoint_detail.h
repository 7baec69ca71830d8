// Internal to the checkpoint code (csrc/checkpoint, zero_optimizer_checkpoint*.cpp):
// the steps of a save that do not need the optimizer's state, shared by the
// synchronous and the asynchronous save and by the load.
#pragma once

#include "zeroshard/checkpoint.h"
#include "zeroshard/communicator.h"
#include "zeroshard/error_agreement.h"
#include "zeroshard/offloaded_optimizer_state.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace zeroshard::checkpoint_detail {

std::string rank_file_name(int64_t rank);
std::string join(const std::string& dir, const std::string& name);
std::string message_of(const std::exception& e);
// Test hook for crash safety: ZEROSHARD_CHECKPOINT_FAULT="<rank>:<point>"
// kills that rank with SIGKILL when it reaches `point` (after_rank_file,
// before_publish, before_latest). Nothing else reads it.
void maybe_inject_fault(const char* point, int64_t rank);
nlohmann::json file_record(const std::string& content);

// One tensor of a rank's data file: `numel` elements of `state` of parameter
// `param` from element `begin`; with `run` > 0, runs of `run` elements
// `stride` apart from there (a tensor-parallel piece, element_runs.h).
struct PieceSpec {
  std::string param;
  std::string state;
  int64_t begin = 0;
  int64_t numel = 0;
  int64_t run = 0;
  int64_t stride = 0;
};

// Writes `dir`/rank_<rank>.safetensors (piece i's values from piece(i)) and
// the rank's extra files, fsynced. Returns the rank's manifest: the file, its
// size, every piece with byte offset and CRC-32C, the extra files' records.
nlohmann::json write_rank_file(const std::string& dir, int64_t rank, int64_t world_size,
                               const std::vector<PieceSpec>& pieces,
                               const std::function<at::Tensor(size_t)>& piece,
                               const CheckpointFiles& rank_files);

// Adds every rank's manifest to the index skeleton (parameters and groups
// already listed, pieces not yet).
void merge_manifests(nlohmann::json& index, const std::vector<std::string>& manifests);

// Rank 0's commit: writes the replicated files and the index into `staging`,
// fsyncs, publishes it as `path` and replaces `latest` when asked.
void publish(const nlohmann::json& index, const std::string& staging, const std::string& path,
             const CheckpointSaveOptions& options);

// The asynchronous save's agreement, through the c10d store instead of
// collectives (it runs on a background thread while training issues
// collectives): each rank posts its manifest or error under `key`; rank 0
// waits for all, merges them into `index`, publishes, and posts the outcome;
// the others wait for it. Returns "" on success, else the error every rank
// sees. `store` may be null when world_size is 1.
std::string commit_through_store(c10d::Store* store, const std::string& key, int64_t rank,
                                 int64_t world_size, const std::string& local_error,
                                 const nlohmann::json& manifest, nlohmann::json index,
                                 const std::string& staging, const std::string& path,
                                 const CheckpointSaveOptions& options);
// What a rank that writes nothing (a replica of the writers, hybrid
// sharding) learns of that agreement: waits for the outcome rank 0 posts
// under `key`; "" on success, else the error the writers raise.
std::string await_commit_outcome(c10d::Store* store, const std::string& key);

// Small files as one byte string and back (length-prefixed, binary-safe), to
// send them through all_gather_strings.
std::string encode_files(const CheckpointFiles& files);
CheckpointFiles decode_files(const std::string& bytes);

}  // namespace zeroshard::checkpoint_detail
