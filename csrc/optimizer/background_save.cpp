#include "background_save.h"

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

}  // namespace zeroshard
