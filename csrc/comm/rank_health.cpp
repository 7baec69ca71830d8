#include "zeroshard/rank_health.h"

#include <algorithm>

namespace zeroshard {
namespace {

std::vector<uint8_t> bytes_of(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

}  // namespace

RankHealth::RankHealth(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int64_t rank,
                       int64_t world_size, std::chrono::milliseconds report_window)
    : store_(std::move(store)),
      prefix_(std::move(prefix)),
      rank_(rank),
      world_size_(world_size),
      report_window_(std::max(report_window, std::chrono::milliseconds(200))) {
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

void RankHealth::publish() {
  try {
    store_->set(key("beat", rank_),
                bytes_of(std::to_string(++count_) + ":" + std::string(1, state_.load())));
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the store's host is gone
  }
}

void RankHealth::beat_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, report_window_ / 4, [this]() { return stop_; })) {
    lock.unlock();
    publish();
    lock.lock();
  }
}

std::vector<RankHealth::Beat> RankHealth::read_beats() {
  std::vector<Beat> beats(world_size_);
  for (int64_t r = 0; r < world_size_; ++r) {
    const std::string k = key("beat", r);
    if (!store_->check({k})) {
      continue;
    }
    const std::vector<uint8_t> value = store_->get(k);
    const std::string text(value.begin(), value.end());
    const size_t colon = text.find(':');
    if (colon != std::string::npos && colon + 1 < text.size()) {
      beats[r] = Beat{std::stoll(text.substr(0, colon)), text[colon + 1]};
    }
  }
  return beats;
}

std::optional<std::vector<int64_t>> RankHealth::lost_ranks(int64_t step) {
  state_.store('f');
  try {
    store_->set(key("failed", rank_), bytes_of(std::to_string(step)));
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
      if (all) {
        return std::vector<int64_t>{};
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const std::vector<Beat> after = read_beats();
    std::vector<int64_t> lost;
    for (int64_t r = 0; r < world_size_; ++r) {
      if (r == rank_ || reported[r]) {
        continue;
      }
      const bool silent = after[r].count < 0 || after[r].count == before[r].count;
      const bool running_elsewhere = after[r].state == 'r';
      if (silent || running_elsewhere) {
        lost.push_back(r);
      }
    }
    return lost;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace zeroshard
