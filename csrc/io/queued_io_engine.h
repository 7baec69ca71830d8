// Internal to csrc/io: what both back ends share. Requests are cut into
// pieces of at most block_size bytes and queued; a back end takes pieces,
// performs them and reports each completion; a ticket is done when all of its
// pieces are. The first failure of a ticket is kept and thrown by wait().
#pragma once

#include "zeroshard/io_engine.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace zeroshard::io_detail {

struct IoPiece {
  IoRequest request;  // a block_size slice of what the caller asked
  IoTicket ticket = 0;
  int64_t done = 0;  // bytes transferred so far (a transfer may be partial)

  char* cursor() const { return static_cast<char*>(request.buffer) + done; }
  int64_t position() const { return request.offset + done; }
  int64_t remaining() const { return request.bytes - done; }
  int fd() const { return request.file->fd_for(cursor(), position(), remaining()); }
};

// "read of 4096 bytes at offset 8192 of '/nvme/x' failed: No space left on device"
std::string describe_failure(const IoPiece& piece, int error);
// A read that met the end of the file before its last byte.
std::string describe_end_of_file(const IoPiece& piece);

class QueuedIoEngine : public IoEngine {
 public:
  explicit QueuedIoEngine(const AioOptions& options);

  IoTicket submit(std::vector<IoRequest> requests) override;
  void wait(IoTicket ticket) override;
  int64_t bytes_read() const override { return bytes_read_.load(); }
  int64_t bytes_written() const override { return bytes_written_.load(); }

 protected:
  // Up to `max` queued pieces; with `block`, waits until there is one or the
  // engine stops (then returns none).
  std::vector<IoPiece> take(size_t max, bool block);
  // Reports a piece: `failure` empty when it succeeded.
  void complete(const IoPiece& piece, const std::string& failure);
  // Wakes blocked take() calls for good; back ends call it before joining.
  void stop();
  const AioOptions& options() const { return options_; }

 private:
  struct TicketState {
    size_t remaining = 0;
    std::string failure;
  };

  AioOptions options_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable ticket_done_;
  std::deque<IoPiece> queue_;
  std::unordered_map<IoTicket, TicketState> tickets_;
  IoTicket next_ticket_ = 1;
  bool stopping_ = false;
  std::atomic<int64_t> bytes_read_{0};
  std::atomic<int64_t> bytes_written_{0};
};

}  // namespace zeroshard::io_detail
