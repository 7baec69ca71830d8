#include "zeroshard/rank_health.h"

#include <algorithm>

namespace zeroshard {
namespace {

// Separates the call from the collective in a record: tags never hold it.
constexpr char kFieldSeparator = '\x1f';

std::vector<uint8_t> bytes_of(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

// "<number>:<state>:<call>\x1f<where>"; older heartbeats end after <state>.
bool parse_record(const std::string& text, int64_t& number, RankActivity& activity) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos || colon + 1 >= text.size()) {
    return false;
  }
  try {
    number = std::stoll(text.substr(0, colon));
  } catch (const std::exception&) {
    return false;
  }
  activity.state = text[colon + 1];
  if (colon + 2 < text.size() && text[colon + 2] == ':') {
    const std::string rest = text.substr(colon + 3);
    const size_t separator = rest.find(kFieldSeparator);
    activity.call = rest.substr(0, separator);
    activity.where = separator == std::string::npos ? "" : rest.substr(separator + 1);
  }
  return true;
}

}  // namespace

std::string RankActivity::describe() const {
  std::string text = "in ";
  if (!call.empty()) {
    text += call;
  } else if (!where.empty()) {
    text += "no call of zeroshard's API (a module or autograd hook)";
  } else {
    text += "none of zeroshard's calls (the script's own code)";
  }
  if (!where.empty()) {
    text += " (" + where + ")";
  } else if (state == 'r') {
    text += " (running, in no collective)";
  }
  return text;
}

RankHealth::RankHealth(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int64_t rank,
                       int64_t world_size, std::chrono::milliseconds report_window)
    : store_(std::move(store)),
      prefix_(std::move(prefix)),
      rank_(rank),
      world_size_(world_size),
      report_window_(std::max(report_window, std::chrono::milliseconds(200))),
      reported_(world_size) {
  publish();
  thread_ = std::thread([this]() { beat_loop(); });
}

RankHealth::~RankHealth() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::string RankHealth::key(const char* what, int64_t rank) const {
  return prefix_ + "/" + what + "/" + std::to_string(rank);
}

void RankHealth::set_waiting(bool waiting, std::string where) {
  std::lock_guard<std::mutex> lock(activity_mutex_);
  state_ = waiting ? 'w' : 'r';
  where_ = std::move(where);
}

void RankHealth::set_call(std::string call) {
  std::lock_guard<std::mutex> lock(activity_mutex_);
  call_ = std::move(call);
}

RankActivity RankHealth::own_activity() {
  std::lock_guard<std::mutex> lock(activity_mutex_);
  return RankActivity{state_, call_, where_};
}

std::string RankHealth::record(int64_t number) {
  const RankActivity own = own_activity();
  return std::to_string(number) + ":" + std::string(1, own.state) + ":" + own.call +
         kFieldSeparator + own.where;
}

void RankHealth::publish() {
  try {
    store_->set(key("beat", rank_), bytes_of(record(++count_)));
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the store's host is gone
  }
}

void RankHealth::read_reported_failures() {
  try {
    const int64_t failures = store_->add(prefix_ + "/failures", 0);
    if (failures == failures_seen_) {
      return;
    }
    failures_seen_ = failures;
    for (int64_t r = 0; r < world_size_; ++r) {
      if (r == rank_) {
        continue;
      }
      std::optional<Beat> report = read_record(key("failed", r));
      if (report) {
        std::lock_guard<std::mutex> lock(activity_mutex_);
        reported_[r] = report->activity;
      }
    }
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the store's host is gone
  }
}

void RankHealth::beat_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, report_window_ / 4, [this]() { return stop_; })) {
    lock.unlock();
    // Read before publishing: a beat that moved twice since a report was
    // written has read it (report_divergence waits for that).
    read_reported_failures();
    publish();
    lock.lock();
  }
}

std::optional<RankHealth::Beat> RankHealth::read_record(const std::string& k) {
  if (!store_->check({k})) {
    return std::nullopt;
  }
  const std::vector<uint8_t> value = store_->get(k);
  Beat beat;
  if (!parse_record(std::string(value.begin(), value.end()), beat.count, beat.activity)) {
    return std::nullopt;
  }
  return beat;
}

std::vector<RankHealth::Beat> RankHealth::read_beats() {
  std::vector<Beat> beats(world_size_);
  for (int64_t r = 0; r < world_size_; ++r) {
    std::optional<Beat> beat = read_record(key("beat", r));
    if (beat) {
      beats[r] = *beat;
    }
  }
  return beats;
}

RankReport RankHealth::diagnose(int64_t step) {
  {
    std::lock_guard<std::mutex> lock(activity_mutex_);
    state_ = 'f';
  }
  RankReport report;
  report.activity.resize(world_size_);
  report.activity[rank_] = own_activity();
  try {
    store_->set(key("failed", rank_), bytes_of(record(step)));
    store_->add(prefix_ + "/failures", 1);
    publish();
    const std::vector<Beat> before = read_beats();
    const auto deadline = std::chrono::steady_clock::now() + report_window_;
    std::vector<bool> reported(world_size_, false);
    while (true) {
      bool all = true;
      for (int64_t r = 0; r < world_size_; ++r) {
        reported[r] = reported[r] || store_->check({key("failed", r)});
        all = all && reported[r];
      }
      if (all || std::chrono::steady_clock::now() >= deadline) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const std::vector<Beat> after = read_beats();
    for (int64_t r = 0; r < world_size_; ++r) {
      if (r == rank_) {
        continue;
      }
      if (reported[r]) {
        std::optional<Beat> failure = read_record(key("failed", r));
        if (failure) {
          report.activity[r] = failure->activity;
        }
        continue;
      }
      if (after[r].count < 0 || after[r].count == before[r].count) {
        report.lost.push_back(r);
        continue;
      }
      report.activity[r] = after[r].activity;
      if (after[r].activity.state == 'r' && after[r].activity.call.empty()) {
        report.stalled.push_back(r);
      }
    }
  } catch (const std::exception&) {
    // The store went with its host rank: what the heartbeat thread read
    // before is all there is.
    report.store_reachable = false;
    std::lock_guard<std::mutex> lock(activity_mutex_);
    for (int64_t r = 0; r < world_size_; ++r) {
      if (r != rank_ && reported_[r]) {
        report.activity[r] = reported_[r];
      }
    }
  }
  return report;
}

std::vector<std::optional<RankActivity>> RankHealth::report_divergence(int64_t step,
                                                                       std::string where) {
  {
    std::lock_guard<std::mutex> lock(activity_mutex_);
    state_ = 'd';
    where_ = std::move(where);
  }
  std::vector<std::optional<RankActivity>> activity(world_size_);
  activity[rank_] = own_activity();
  try {
    store_->set(key("failed", rank_), bytes_of(record(step)));
    store_->add(prefix_ + "/failures", 1);
    publish();
    const std::vector<Beat> before = read_beats();
    const auto deadline = std::chrono::steady_clock::now() + report_window_;
    std::vector<Beat> now = before;
    while (true) {
      bool all = true;
      for (int64_t r = 0; r < world_size_; ++r) {
        if (r == rank_) {
          continue;
        }
        std::optional<Beat> failure = read_record(key("failed", r));
        if (failure) {
          activity[r] = failure->activity;
          continue;
        }
        const bool read_it = before[r].count >= 0 && now[r].count >= before[r].count + 2;
        if (read_it) {
          activity[r] = now[r].activity;
        }
        all = all && read_it;
      }
      if (all || std::chrono::steady_clock::now() >= deadline) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      now = read_beats();
    }
    for (int64_t r = 0; r < world_size_; ++r) {
      if (!activity[r] && now[r].count >= 0 && now[r].count != before[r].count) {
        activity[r] = now[r].activity;  // alive, may not have read the report yet
      }
    }
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the store is gone
  }
  return activity;
}

}  // namespace zeroshard
