// ZeroOptimizer: hybrid sharding. The shard group holds one copy of the
// sharded state; each replica (another shard group, the same layout) holds
// another. Only three things cross replicas: the initial parameters (replica
// 0's), the reduced gradient shards (summed, once per step, Ψ/N elements per
// rank), and the step's agreements (presence flags, errors), so the replicas
// take identical steps. Parameter all-gathers never leave the shard group.
#include "zero_optimizer_impl.h"

#include "zeroshard/error_agreement.h"
#include "zeroshard/shard_chunk.h"

#include "../checkpoint/checkpoint_detail.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <string>
#include <vector>

namespace zeroshard {

void ZeroOptimizer::Impl::save_checkpoint(const std::string& path,
                                          const CheckpointSaveOptions& options) {
  check_groups_fixed();
  // [Note: the step's phase]: agreed, so that a rank whose state is
  // incomplete does not refuse alone while the others wait in the save.
  const std::string incomplete = groups_->agree(step_phase_.incomplete_reason(), "save_refusal");
  TORCH_CHECK(incomplete.empty(), "zeroshard: save_checkpoint() refused ", incomplete);
  if (!groups_->replica()) {
    save_checkpoint_shards(path, options);
    return;
  }
  // Replicas hold the same shards: the first one writes them, and the others
  // learn its outcome, so every rank returns or raises alike. Each rank's own
  // files (its RNG states) travel to its first-replica counterpart, which
  // writes them with its own, so every rank resumes its own random streams.
  // An asynchronous save's outcome reaches the other replicas through the
  // checkpoint store: their wait_for_checkpoint raises what the writers do.
  const bool writer = groups_->replica()->rank() == 0;
  // The previous asynchronous save's outcome, on writers and observers alike:
  // it is reported by the first agreement below, with a refusal of this save's
  // names if there is one, so that neither hides the other.
  const std::string previous_error = async_saver_.finish();
  std::string observer_error;  // the other replicas': their checkpoint store
  std::pair<c10::intrusive_ptr<c10d::Store>, std::string> commit;
  const std::vector<std::string> replica_files =
      all_gather_strings(*groups_->replica(), checkpoint_detail::encode_files(options.rank_files()),
                         "replicas/checkpoint_rank_files");
  CheckpointSaveOptions with_replicas = options;
  std::string refusal;
  if (groups_->replica()->rank() == 0) {
    for (size_t r = 1; r < replica_files.size(); ++r) {
      for (auto& [name, content] : checkpoint_detail::decode_files(replica_files[r])) {
        if (!with_replicas.rank_files().emplace(name, std::move(content)).second) {
          refusal = "rank file '" + name +
                    "' is given by two replicas; rank file names must differ between ranks "
                    "(name them by checkpoint_rank())";
        }
      }
    }
  }
  // Agreed by every rank (shard, replicate and tensor-parallel groups) before
  // any of them enters the save's own agreements.
  if (!previous_error.empty()) {
    refusal += std::string(refusal.empty() ? "" : "; ") + previous_error;
  }
  const std::string refused = groups_->agree(refusal, "checkpoint_rank_file_names");
  TORCH_CHECK_VALUE(refused.empty(), "could not save checkpoint ", path, " ", refused);
  // Counted here, where the writers count theirs (in save_checkpoint_shards):
  // a save refused above counts on no rank.
  if (!writer && options.async_save()) {
    try {
      commit = async_saver_.next_commit(checkpoint_path(path, ""), *groups_);
    } catch (const c10::Error& e) {
      observer_error = e.what_without_backtrace();
    }
  }
  std::string error = observer_error;
  if (writer) {
    try {
      save_checkpoint_shards(path, with_replicas);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Over every group, not the replicas alone: an observer's own error (its
  // store) is seen by no writer.
  const std::string agreed = groups_->agree(error, "replicas/checkpoint");
  if (!agreed.empty()) {
    // A writer's save may be in flight after a failure elsewhere (another
    // replica's store): it finishes, and its outcome is reported to stderr.
    async_saver_.finish_quietly();
  }
  TORCH_CHECK_VALUE(agreed.empty(), "could not save checkpoint ", path, " (replicas ", agreed, ")");
  if (!writer && options.async_save()) {
    // This replica writes nothing: its save is the wait for the writers'.
    async_saver_.start(
        checkpoint_path(path, ""),
        [store = BackgroundSave::own_connection(commit.first), key = commit.second]() {
          return checkpoint_detail::await_commit_outcome(store.get(), key);
        });
  }
}

}  // namespace zeroshard
