#include "background_save.h"

#include "../checkpoint/checkpoint_detail.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <exception>
#include <utility>

namespace zeroshard {

BackgroundSave::BackgroundSave(std::string path, std::function<std::string()> work)
    : path_(std::move(path)), thread_([this, work = std::move(work)]() { error_ = work(); }) {}

BackgroundSave::~BackgroundSave() {
  if (thread_.joinable()) {
    thread_.join();
  }
}

std::string BackgroundSave::finish() {
  if (thread_.joinable()) {
    thread_.join();
  }
  if (error_.empty()) {
    return "";
  }
  return "the asynchronous save of checkpoint " + path_ + " failed " + error_ +
         "; unless it was committed, the previous checkpoint and `latest` are unchanged";
}

c10::intrusive_ptr<c10d::Store> BackgroundSave::own_connection(
    c10::intrusive_ptr<c10d::Store> store) {
  if (store) {
    try {
      return store->clone();
    } catch (const std::exception&) {  // a store that cannot be cloned: share it
    }
  }
  return store;
}

void AsyncCheckpointSaver::set_store(c10::intrusive_ptr<c10d::Store> store, std::string prefix) {
  store_ = std::move(store);
  store_prefix_ = std::move(prefix);
}

std::pair<c10::intrusive_ptr<c10d::Store>, std::string> AsyncCheckpointSaver::next_commit(
    const std::string& path, const ProcessGroups& groups) {
  const std::string count = std::to_string(saves_started_++);
  // Only where the shard group's store does not reach every rank: a plain
  // data-parallel save keeps its own group's keys.
  if (store_ && (groups.model_parallel() || groups.replica())) {
    // The prefix counts this process's optimizers; the path tells apart
    // those of other processes counted alike (each pipeline stage's).
    return {store_, store_prefix_ + "/" + path + "/save" + count};
  }
  // A shard group's store reaches only its own ranks.
  TORCH_CHECK_VALUE(
      !groups.model_parallel() && !groups.replica(), "async_save with ",
      groups.model_parallel() ? "tensor- or expert-parallel parameters" : "hybrid sharding",
      " needs a c10d store that every rank of the checkpoint reaches, to agree on "
      "the commit off the collective stream: call set_checkpoint_store(store, "
      "prefix) first, e.g. with the default group's store (the Python layer does)");
  TORCH_CHECK_VALUE(groups.checkpoint_writer_count() == 1 || groups.shard().store(),
                    "async_save needs the process group's c10d store to agree on the commit "
                    "off the collective stream: call set_checkpoint_store(store, prefix) or "
                    "set_failure_store(store, prefix) first (the Python layer does)");
  return {groups.shard().store(), groups.shard().store_prefix() + "/checkpoint" + count};
}

void AsyncCheckpointSaver::start(std::string path, std::function<std::string()> work) {
  TORCH_INTERNAL_ASSERT(pending_ == nullptr, "a save started before the previous one finished");
  pending_ = std::make_unique<BackgroundSave>(std::move(path), std::move(work));
}

std::string AsyncCheckpointSaver::finish() {
  if (!pending_) {
    return "";
  }
  std::unique_ptr<BackgroundSave> pending = std::move(pending_);
  return pending->finish();
}

void AsyncCheckpointSaver::wait() {
  const std::string error = finish();
  TORCH_CHECK_VALUE(error.empty(), error);
}

void AsyncCheckpointSaver::finish_quietly() noexcept {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[zeroshard] %s\n", checkpoint_detail::message_of(e).c_str());
  }
}

}  // namespace zeroshard
