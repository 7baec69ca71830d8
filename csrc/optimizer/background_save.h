// Asynchronous checkpoint saves (CheckpointSaveOptions::async_save): one
// save in flight (BackgroundSave) and the optimizer's part that starts them,
// names their commits and reports their outcome (AsyncCheckpointSaver).
// Internal to csrc/optimizer/.
#pragma once

#include "zeroshard/process_groups.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

namespace zeroshard {

// One save in flight: the thread that writes the state copied at save time
// and agrees on the commit, or (a rank of another replica) waits for the
// writers' outcome; and that outcome.
class BackgroundSave {
 public:
  // Runs `work` on a thread of its own; it returns its error ("" when the
  // checkpoint committed).
  BackgroundSave(std::string path, std::function<std::string()> work);
  ~BackgroundSave();  // joins: a save is never abandoned half-written
  BackgroundSave(const BackgroundSave&) = delete;
  BackgroundSave& operator=(const BackgroundSave&) = delete;

  // Joins the thread. "" when the save committed; else what failed, naming
  // the checkpoint and what is left on disk.
  std::string finish();

  // A connection of its own to `store` for the thread's long waits (a store
  // client serializes its calls, and the failure reports and torch's own use
  // must not wait behind them); `store` itself where it cannot be cloned.
  static c10::intrusive_ptr<c10d::Store> own_connection(c10::intrusive_ptr<c10d::Store> store);

 private:
  std::string path_;
  std::string error_;  // written by the thread, read after the join
  std::thread thread_;
};

// At most one save in flight per optimizer; a new save, a load and the
// optimizer's destruction first finish the previous one.
class AsyncCheckpointSaver {
 public:
  // A store every rank of a checkpoint reaches (set_checkpoint_store): needed
  // where the shard group's own store does not (tensor/expert parallelism,
  // hybrid sharding). Keys go under `prefix`.
  void set_store(c10::intrusive_ptr<c10d::Store> store, std::string prefix);
  // The store and key on which the ranks of the next save of `path` agree
  // (the same on every rank: each counts its saves); throws where no store
  // reaches them all.
  std::pair<c10::intrusive_ptr<c10d::Store>, std::string> next_commit(const std::string& path,
                                                                      const ProcessGroups& groups);
  // Starts the save in flight (after finish()).
  void start(std::string path, std::function<std::string()> work);
  bool in_flight() const { return pending_ != nullptr; }
  // Joins the save in flight; its error ("" if none or none in flight).
  std::string finish();
  // finish(), raising its error.
  void wait();
  // wait(), reporting an error to stderr instead: a destructor's, or after
  // another failure that is being raised.
  void finish_quietly() noexcept;

 private:
  std::unique_ptr<BackgroundSave> pending_;
  int64_t saves_started_ = 0;  // names the store keys
  c10::intrusive_ptr<c10d::Store> store_;
  std::string store_prefix_;
};

}  // namespace zeroshard
