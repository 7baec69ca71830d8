// Which ranks are gone when a collective fails.
//
// [Note: Naming a lost rank]
// A backend error says that a connection closed or a wait timed out, not which
// rank is gone; and a rank whose neighbour died may itself sit blocked in a
// collective until the timeout, so "the ranks that did not report a failure"
// would name innocent ranks too. So each rank publishes a heartbeat through
// the process group's store, "<prefix>/beat/<rank>" = "<count>:<state>", from
// a thread of its own: state 'w' while it waits in a collective, 'r' while it
// runs anything else, 'f' once a collective failed. When a collective fails, a
// rank writes "<prefix>/failed/<rank>", watches the others for a report
// window, and names as lost every rank that neither reported a failure nor
// was blocked in a collective: one whose heartbeat stopped (killed, crashed)
// or that kept running outside collectives while the others waited for it
// (stalled).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace zeroshard {

class RankHealth {
 public:
  // Starts the heartbeat thread. `report_window` bounds how long lost_ranks()
  // watches the others; heartbeats come four times per window.
  RankHealth(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int64_t rank,
             int64_t world_size, std::chrono::milliseconds report_window);
  ~RankHealth();
  RankHealth(const RankHealth&) = delete;
  RankHealth& operator=(const RankHealth&) = delete;

  // This rank now waits in a collective (true) or runs anything else (false).
  void set_waiting(bool waiting) { state_.store(waiting ? 'w' : 'r'); }

  // Reports this rank's failure and returns the ranks found lost, or nullopt
  // when the store itself is unreachable (its host rank died).
  std::optional<std::vector<int64_t>> lost_ranks(int64_t step);

  std::chrono::milliseconds report_window() const { return report_window_; }

 private:
  struct Beat {
    int64_t count = -1;  // -1: never seen
    char state = '?';
  };
  void beat_loop();
  void publish();
  std::vector<Beat> read_beats();
  std::string key(const char* what, int64_t rank) const;

  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int64_t rank_;
  int64_t world_size_;
  std::chrono::milliseconds report_window_;
  std::atomic<char> state_{'r'};
  int64_t count_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace zeroshard
