#include "queued_io_engine.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <sstream>

namespace zeroshard::io_detail {

std::string describe_failure(const IoPiece& piece, int error) {
  std::ostringstream out;
  out << io_op_name(piece.request.op) << " of " << piece.remaining() << " bytes at offset "
      << piece.position() << " of '" << piece.request.file->path()
      << "' failed: " << std::strerror(error);
  if (error == ENOSPC) {
    out << " (the disk under nvme_path is full)";
  }
  return out.str();
}

std::string describe_end_of_file(const IoPiece& piece) {
  std::ostringstream out;
  out << "read of " << piece.request.bytes << " bytes at offset " << piece.request.offset << " of '"
      << piece.request.file->path() << "' met the end of the file after " << piece.done
      << " bytes: the file is shorter than expected (truncated or replaced?)";
  return out.str();
}

QueuedIoEngine::QueuedIoEngine(const AioOptions& options) : options_(options) {
  check_aio_options(options_);
}

IoTicket QueuedIoEngine::submit(std::vector<IoRequest> requests) {
  const int64_t block = options_.block_size();
  // Every request is checked before any is queued: a refused batch runs nothing.
  for (const IoRequest& request : requests) {
    TORCH_CHECK(request.file != nullptr && request.bytes >= 0 && request.offset >= 0 &&
                    (request.buffer != nullptr || request.bytes == 0),
                "zeroshard I/O: invalid request (file ", request.file, ", offset ", request.offset,
                ", ", request.bytes, " bytes, buffer ", request.buffer, ")");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const IoTicket ticket = next_ticket_++;
  TicketState& state = tickets_[ticket];
  for (const IoRequest& request : requests) {
    for (int64_t at = 0; at < request.bytes; at += block) {
      IoPiece piece;
      piece.request = request;
      piece.request.offset = request.offset + at;
      piece.request.buffer = static_cast<char*>(request.buffer) + at;
      piece.request.bytes = std::min(block, request.bytes - at);
      piece.ticket = ticket;
      queue_.push_back(piece);
      ++state.remaining;
    }
  }
  if (state.remaining == 0) {
    tickets_.erase(ticket);  // nothing to wait for
  } else {
    work_ready_.notify_all();
  }
  return ticket;
}

void QueuedIoEngine::wait(IoTicket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return;  // empty, or waited for already
  }
  // A pointer, not the iterator: a submit() while we wait may rehash the map
  // (which keeps references valid, not iterators).
  TicketState* state = &it->second;
  ticket_done_.wait(lock, [&] { return state->remaining == 0; });
  const std::string failure = std::move(state->failure);
  tickets_.erase(ticket);
  TORCH_CHECK(failure.empty(), "zeroshard NVMe I/O (", backend(), "): ", failure);
}

std::vector<IoPiece> QueuedIoEngine::take(size_t max, bool block) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (block) {
    work_ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
  }
  std::vector<IoPiece> out;
  while (!queue_.empty() && out.size() < max) {
    out.push_back(queue_.front());
    queue_.pop_front();
  }
  return out;
}

void QueuedIoEngine::complete(const IoPiece& piece, const std::string& failure) {
  if (failure.empty()) {
    (piece.request.op == IoOp::kRead ? bytes_read_ : bytes_written_) += piece.request.bytes;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  TicketState& state = tickets_.at(piece.ticket);
  if (!failure.empty() && state.failure.empty()) {
    state.failure = failure;
  }
  if (--state.remaining == 0) {
    ticket_done_.notify_all();
  }
}

void QueuedIoEngine::stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  stopping_ = true;
  work_ready_.notify_all();
}

}  // namespace zeroshard::io_detail
