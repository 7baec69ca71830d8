// One asynchronous checkpoint save in flight (CheckpointSaveOptions::
// async_save): the thread that writes the state copied at save time and
// agrees on the commit, or (a rank of another replica) waits for the
// writers' outcome; and that outcome. Internal to csrc/optimizer/.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <string>
#include <thread>

namespace zeroshard {

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

}  // namespace zeroshard
