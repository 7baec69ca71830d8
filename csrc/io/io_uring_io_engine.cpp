// The io_uring back end: one thread owns the ring, keeps up to queue_depth
// pieces in flight, and resubmits the rest of a partial transfer.
#include "queued_io_engine.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <vector>

#if ZEROSHARD_WITH_LIBURING
#include <liburing.h>
#endif

namespace zeroshard {

#if ZEROSHARD_WITH_LIBURING
namespace {

class IoUringEngine final : public io_detail::QueuedIoEngine {
 public:
  explicit IoUringEngine(const AioOptions& options) : QueuedIoEngine(options) {
    const int error = io_uring_queue_init(static_cast<unsigned>(options.queue_depth()), &ring_, 0);
    TORCH_CHECK(error == 0,
                "io_uring is not available: io_uring_queue_init failed: ", std::strerror(-error));
    thread_ = std::thread([this] { work(); });
  }
  ~IoUringEngine() override {
    stop();
    thread_.join();
    io_uring_queue_exit(&ring_);
  }
  const char* backend() const override { return "io_uring"; }

 private:
  // Queues a piece in the submission ring; false when the ring has no room
  // (it then stays with the caller).
  bool prepare(io_detail::IoPiece* piece) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      return false;
    }
    if (piece->request.op == IoOp::kRead) {
      io_uring_prep_read(sqe, piece->fd(), piece->cursor(), piece->remaining(), piece->position());
    } else {
      io_uring_prep_write(sqe, piece->fd(), piece->cursor(), piece->remaining(), piece->position());
    }
    io_uring_sqe_set_data(sqe, piece);
    live_.insert(piece);
    if (options().single_submit()) {
      flush();
    }
    return true;
  }

  // Hands what is prepared to the kernel. A busy ring (EAGAIN, EBUSY, or
  // nothing taken) is left for after the next completions; other errors
  // throw (and fail every piece, see work()).
  void flush() {
    while (io_uring_sq_ready(&ring_) > 0) {
      const int submitted = io_uring_submit(&ring_);
      if (submitted == -EINTR) {
        continue;
      }
      if (submitted == -EAGAIN || submitted == -EBUSY || submitted == 0) {
        return;
      }
      TORCH_CHECK(submitted > 0, "io_uring_submit failed: ", std::strerror(-submitted));
    }
  }

  void complete_piece(io_detail::IoPiece* raw, const std::string& failure) {
    std::unique_ptr<io_detail::IoPiece> piece(raw);
    live_.erase(raw);
    complete(*piece, failure);
  }

  // One completion: done, failed, or (partial, EINTR, EAGAIN) submitted again.
  // Returns whether the piece left the ring for good.
  bool handle(io_uring_cqe* cqe) {
    auto* piece = static_cast<io_detail::IoPiece*>(io_uring_cqe_get_data(cqe));
    const int result = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    live_.erase(piece);
    if (result == -EINTR || result == -EAGAIN) {
      return !resubmit(piece);
    }
    if (result < 0) {
      complete_piece(piece, io_detail::describe_failure(*piece, -result));
      return true;
    }
    if (result == 0) {
      complete_piece(piece, piece->request.op == IoOp::kRead
                                ? io_detail::describe_end_of_file(*piece)
                                : io_detail::describe_failure(*piece, ENOSPC));
      return true;
    }
    piece->done += result;
    if (piece->remaining() == 0) {
      complete_piece(piece, "");
      return true;
    }
    return !resubmit(piece);  // partial: the rest goes again
  }

  bool resubmit(io_detail::IoPiece* piece) {
    if (!prepare(piece)) {
      flush();
      if (!prepare(piece)) {
        complete_piece(piece, "io_uring submission queue full on a retry");
        return false;
      }
    }
    return true;
  }

  void work() {
    const auto depth = static_cast<size_t>(options().queue_depth());
    size_t in_flight = 0;
    try {
      for (;;) {
        if (in_flight == 0 || options().overlap_events()) {
          for (io_detail::IoPiece& taken : take(depth - in_flight, /*block=*/in_flight == 0)) {
            auto* piece = new io_detail::IoPiece(taken);
            if (!prepare(piece)) {  // cannot happen: at most `depth` pieces are in the ring
              delete piece;
              complete(taken, "io_uring submission queue full");
              continue;
            }
            ++in_flight;
          }
        }
        if (in_flight == 0) {
          return;  // stopping, and nothing queued
        }
        flush();
        if (io_uring_sq_ready(&ring_) == in_flight) {
          // The kernel took nothing yet (busy): nothing to wait for but time.
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          continue;
        }
        // Without overlap_events the whole batch completes before the next.
        const size_t wanted = options().overlap_events() ? 1 : in_flight;
        for (size_t reaped = 0; reaped < wanted && in_flight > 0;) {
          io_uring_cqe* cqe = nullptr;
          const int error = io_uring_wait_cqe(&ring_, &cqe);
          if (error == -EINTR) {
            continue;
          }
          TORCH_CHECK(error == 0, "io_uring_wait_cqe failed: ", std::strerror(-error));
          if (handle(cqe)) {
            --in_flight;
            ++reaped;
          }
          flush();
        }
      }
    } catch (const std::exception& e) {
      // The ring is unusable: every piece in it and every later one fails with
      // the reason, so no wait() hangs and the process is not terminated.
      const std::string failure = std::string("the io_uring back end failed: ") + e.what();
      for (io_detail::IoPiece* piece :
           std::vector<io_detail::IoPiece*>(live_.begin(), live_.end())) {
        complete_piece(piece, failure);
      }
      for (;;) {
        std::vector<io_detail::IoPiece> pieces = take(depth, /*block=*/true);
        if (pieces.empty()) {
          return;
        }
        for (const io_detail::IoPiece& piece : pieces) {
          complete(piece, failure);
        }
      }
    }
  }

  std::unordered_set<io_detail::IoPiece*> live_;  // in the ring (owned, by raw pointer)
  io_uring ring_{};
  std::thread thread_;
};

}  // namespace

bool io_uring_available(std::string* why_not) {
  static std::once_flag once;
  static int probe = 0;
  std::call_once(once, [] {
    io_uring ring{};
    probe = io_uring_queue_init(2, &ring, 0);
    if (probe == 0) {
      io_uring_queue_exit(&ring);
    }
  });
  if (probe != 0 && why_not != nullptr) {
    *why_not = std::string("io_uring_queue_init failed: ") + std::strerror(-probe) +
               (probe == -EPERM || probe == -ENOSYS
                    ? " (blocked by the kernel's io_uring_disabled setting or a seccomp profile)"
                    : "");
  }
  return probe == 0;
}

std::unique_ptr<IoEngine> make_io_uring_engine(const AioOptions& options) {
  std::string why_not;
  TORCH_CHECK(io_uring_available(&why_not), "io_uring is not available here: ", why_not);
  return std::make_unique<IoUringEngine>(options);
}

#else  // !ZEROSHARD_WITH_LIBURING

bool io_uring_available(std::string* why_not) {
  if (why_not != nullptr) {
    *why_not = "zeroshard was built without liburing (install liburing-dev and rebuild)";
  }
  return false;
}

std::unique_ptr<IoEngine> make_io_uring_engine(const AioOptions& /*options*/) {
  TORCH_CHECK(false,
              "io_uring is not available here: zeroshard was built without liburing "
              "(install liburing-dev and rebuild)");
}

#endif

std::unique_ptr<IoEngine> make_io_engine(const AioOptions& options) {
  std::string why_not;
  if (options.use_io_uring() && io_uring_available(&why_not)) {
    try {
      return make_io_uring_engine(options);
    } catch (const c10::Error& e) {
      // The probe's small ring worked and this one did not (e.g. a memlock
      // limit too low for queue_depth entries on older kernels).
      why_not = e.what_without_backtrace();
    }
  }
  if (options.use_io_uring()) {
    TORCH_WARN_ONCE("zeroshard: NVMe I/O uses a pread/pwrite thread pool of ",
                    options.intra_op_parallelism(),
                    " thread(s) because io_uring is not available (", why_not,
                    "); raise aio.intra_op_parallelism for more parallel requests");
  }
  return make_thread_pool_io_engine(options);
}

}  // namespace zeroshard
