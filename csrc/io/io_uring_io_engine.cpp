// The io_uring back end: one thread owns the ring, keeps up to queue_depth
// pieces in flight, and resubmits the rest of a partial transfer.
#include "queued_io_engine.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

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
  void prepare(io_detail::IoPiece* piece) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    TORCH_INTERNAL_ASSERT(sqe != nullptr, "io_uring submission queue full");
    if (piece->request.op == IoOp::kRead) {
      io_uring_prep_read(sqe, piece->fd(), piece->cursor(), piece->remaining(), piece->position());
    } else {
      io_uring_prep_write(sqe, piece->fd(), piece->cursor(), piece->remaining(), piece->position());
    }
    io_uring_sqe_set_data(sqe, piece);
    if (options().single_submit()) {
      io_uring_submit(&ring_);
    }
  }

  void work() {
    const auto depth = static_cast<size_t>(options().queue_depth());
    size_t in_flight = 0;
    for (;;) {
      if (in_flight == 0 || options().overlap_events()) {
        for (io_detail::IoPiece& taken : take(depth - in_flight, /*block=*/in_flight == 0)) {
          prepare(new io_detail::IoPiece(taken));
          ++in_flight;
        }
      }
      if (in_flight == 0) {
        return;  // stopping, and nothing queued
      }
      if (!options().single_submit()) {
        io_uring_submit(&ring_);
      }
      // Without overlap_events the whole batch completes before the next.
      const size_t wanted = options().overlap_events() ? 1 : in_flight;
      size_t reaped = 0;
      while (reaped < wanted) {
        io_uring_cqe* cqe = nullptr;
        const int error = io_uring_wait_cqe(&ring_, &cqe);
        if (error == -EINTR) {
          continue;
        }
        TORCH_INTERNAL_ASSERT(error == 0, "io_uring_wait_cqe: ", std::strerror(-error));
        std::unique_ptr<io_detail::IoPiece> piece(
            static_cast<io_detail::IoPiece*>(io_uring_cqe_get_data(cqe)));
        const int result = cqe->res;
        io_uring_cqe_seen(&ring_, cqe);
        ++reaped;
        if (result == -EINTR || result == -EAGAIN) {
          prepare(piece.release());  // retried; still in flight
          --reaped;
          if (!options().single_submit()) {
            io_uring_submit(&ring_);
          }
          continue;
        }
        std::string failure;
        if (result < 0) {
          failure = io_detail::describe_failure(*piece, -result);
        } else if (result == 0) {
          failure = piece->request.op == IoOp::kRead ? io_detail::describe_end_of_file(*piece)
                                                     : io_detail::describe_failure(*piece, ENOSPC);
        } else {
          piece->done += result;
          if (piece->remaining() > 0) {  // partial: the rest goes again
            prepare(piece.release());
            --reaped;
            if (!options().single_submit()) {
              io_uring_submit(&ring_);
            }
            continue;
          }
        }
        --in_flight;
        complete(*piece, failure);
      }
    }
  }

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
    return make_io_uring_engine(options);
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
