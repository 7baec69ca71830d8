// The fallback back end: intra_op_parallelism threads, each performing one
// piece at a time with pread/pwrite.
#include "queued_io_engine.h"

#include <unistd.h>
#include <cerrno>
#include <thread>

namespace zeroshard {
namespace {

class ThreadPoolIoEngine final : public io_detail::QueuedIoEngine {
 public:
  explicit ThreadPoolIoEngine(const AioOptions& options) : QueuedIoEngine(options) {
    for (int64_t i = 0; i < options.intra_op_parallelism(); ++i) {
      workers_.emplace_back([this] { work(); });
    }
  }
  ~ThreadPoolIoEngine() override {
    stop();
    for (auto& worker : workers_) {
      worker.join();
    }
  }
  const char* backend() const override { return "thread pool"; }

 private:
  void work() {
    for (;;) {
      std::vector<io_detail::IoPiece> pieces = take(1, /*block=*/true);
      if (pieces.empty()) {
        return;  // stopping, and nothing queued
      }
      io_detail::IoPiece& piece = pieces.front();
      complete(piece, perform(piece));
    }
  }

  static std::string perform(io_detail::IoPiece& piece) {
    while (piece.remaining() > 0) {
      const ssize_t n =
          piece.request.op == IoOp::kRead
              ? ::pread(piece.fd(), piece.cursor(), piece.remaining(), piece.position())
              : ::pwrite(piece.fd(), piece.cursor(), piece.remaining(), piece.position());
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n < 0) {
        return io_detail::describe_failure(piece, errno);
      }
      if (n == 0) {
        return piece.request.op == IoOp::kRead ? io_detail::describe_end_of_file(piece)
                                               : io_detail::describe_failure(piece, ENOSPC);
      }
      piece.done += n;
    }
    return {};
  }

  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoEngine> make_thread_pool_io_engine(const AioOptions& options) {
  return std::make_unique<ThreadPoolIoEngine>(options);
}

}  // namespace zeroshard
