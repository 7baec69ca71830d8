// Which ranks are gone, and which call each rank is in, when a collective
// fails.
//
// [Note: Naming a lost rank]
// A backend error says that a connection closed or a wait timed out, not which
// rank is gone; and a rank whose neighbour died may itself sit blocked in a
// collective until the timeout, so "the ranks that did not report a failure"
// would name innocent ranks too. So each rank publishes a heartbeat through
// the process group's store, "<prefix>/beat/<rank>" =
// "<count>:<state>:<call>\x1f<where>", from a thread of its own: state 'w'
// while it waits in a collective, 'r' while it runs anything else, 'f' once a
// collective failed; <call> is the public call it is in (step,
// full_state_dict, save_checkpoint, forward; empty outside them) and <where>
// the collective it waits in. The training thread only stores these in
// memory: the thread publishes them with the beat, so the hot path gains no
// store write. When a collective fails, a rank writes "<prefix>/failed/<rank>"
// (the same record), watches the others for a report window, and names as
// lost only a rank whose heartbeat stopped (killed, crashed). A rank whose
// heartbeat goes on is alive: it is named with the call it is in, "rank 1 is
// in save_checkpoint (...)", or as stalled when it runs outside every call of
// zeroshard while the others wait for it.
//
// [Note: Ranks in different calls]
// A rank whose order check finds that the others issue another collective
// (one rank in full_state_dict, the other in the next step) writes its record
// as "<prefix>/failed/<rank>" with state 'd' and bumps "<prefix>/failures"
// before raising. Each heartbeat thread reads that counter once a beat and
// keeps the others' records in memory, so a rank whose collective then fails
// can name the other rank's call even when the store went with the rank that
// raised (env:// hosts it on rank 0). The rank that raises waits, at most a
// report window, until every other rank's heartbeat has moved twice (it has
// read the record), and names the others' calls from their heartbeats.
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

// What a rank was doing, as it published it.
struct RankActivity {
  char state = '?';   // 'w' waits in a collective, 'r' runs, 'f' failed, 'd' found a divergence
  std::string call;   // the public call it is in; empty: none
  std::string where;  // e.g. "waiting in all_reduce 'agreement_counts'"
  // "in full_state_dict (about to issue all_gather 'full_parameters/group0/bucket0' ...)".
  std::string describe() const;
};

// What RankHealth found about the others when a collective failed.
struct RankReport {
  bool store_reachable = true;   // false: activities come from the heartbeat's memory
  std::vector<int64_t> lost;     // heartbeat stopped: killed, crashed
  std::vector<int64_t> stalled;  // alive, outside every call, while the others waited
  std::vector<std::optional<RankActivity>> activity;  // per rank; nullopt: unknown
};

class RankHealth {
 public:
  // Starts the heartbeat thread. `report_window` bounds how long diagnose()
  // watches the others; heartbeats come four times per window.
  RankHealth(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int64_t rank,
             int64_t world_size, std::chrono::milliseconds report_window);
  ~RankHealth();
  RankHealth(const RankHealth&) = delete;
  RankHealth& operator=(const RankHealth&) = delete;

  // This rank now waits in the collective `where` (true) or runs anything
  // else (false). In memory only: the heartbeat thread publishes it.
  void set_waiting(bool waiting, std::string where);
  // The public call this rank is in; empty when it left it.
  void set_call(std::string call);

  // Reports this rank's failure and what it finds about the others.
  RankReport diagnose(int64_t step);
  // Reports that this rank found the ranks diverged, about to issue `where`;
  // waits (at most a report window) until the others have read it and
  // returns each rank's activity (nullopt: unknown).
  std::vector<std::optional<RankActivity>> report_divergence(int64_t step, std::string where);

  std::chrono::milliseconds report_window() const { return report_window_; }

 private:
  struct Beat {
    int64_t count = -1;  // -1: never seen
    RankActivity activity;
  };
  void beat_loop();
  void publish();
  void read_reported_failures();
  RankActivity own_activity();
  std::string record(int64_t number);
  std::vector<Beat> read_beats();
  std::optional<Beat> read_record(const std::string& key);
  std::string key(const char* what, int64_t rank) const;

  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int64_t rank_;
  int64_t world_size_;
  std::chrono::milliseconds report_window_;
  std::mutex activity_mutex_;  // guards state_, call_, where_, reported_
  char state_ = 'r';
  std::string call_;
  std::string where_;
  // The others' failure records, read by the heartbeat thread (see
  // [Note: Ranks in different calls]).
  std::vector<std::optional<RankActivity>> reported_;
  int64_t failures_seen_ = 0;
  std::atomic<int64_t> count_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace zeroshard
