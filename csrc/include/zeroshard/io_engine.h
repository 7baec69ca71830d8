// Asynchronous positional file I/O for the NVMe tier (see docs/design.md,
// "NVMe"). Two back ends behind one interface: io_uring (liburing), and a
// pread/pwrite thread pool that takes over where io_uring is unavailable at
// run time (container seccomp profiles block it); the library says once which
// one runs and why.
//
//   auto engine = zeroshard::make_io_engine(zeroshard::AioOptions().queue_depth(32));
//   auto file = zeroshard::IoFile::open("/nvme/swap", zeroshard::IoFile::Mode::kCreate, bytes);
//   auto ticket = engine->submit({{file.get(), IoOp::kWrite, 0, buffer, n}});
//   ... (overlapped work)
//   engine->wait(ticket);  // throws naming the file, the operation and the offset
//
// Files are opened once and kept open, with O_DIRECT where the file system
// accepts it (buffered I/O, with a one-time notice, where it does not, e.g.
// tmpfs). Requests whose buffer, offset or size are not multiples of the
// file's alignment go through a second, buffered descriptor of the same file:
// Linux writes back dirty cached pages of a range before a direct read of it,
// so both paths see the same bytes. Large requests are cut into block_size
// pieces, at most queue_depth of them in flight.
//
// Thread-safety: submit() and wait() may be called from any thread; requests
// of one ticket may complete in any order. The caller keeps each buffer and
// file alive, and does not touch a buffer, until its ticket was waited for.
#pragma once

#include <torch/csrc/api/include/torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

// DeepSpeed's "aio" section, with its defaults.
struct AioOptions {
  // Bytes per request piece.
  TORCH_ARG(int64_t, block_size) = 1048576;
  // Pieces in flight at once.
  TORCH_ARG(int64_t, queue_depth) = 8;
  // Threads of the thread-pool back end (io_uring needs none).
  TORCH_ARG(int64_t, intra_op_parallelism) = 1;
  // io_uring: one system call per piece instead of one per batch.
  TORCH_ARG(bool, single_submit) = false;
  // io_uring: submit new pieces while earlier ones are still completing
  // (false: wait for the whole batch first).
  TORCH_ARG(bool, overlap_events) = true;
  // false: the thread pool, whatever the system supports (also for tests).
  TORCH_ARG(bool, use_io_uring) = true;
};

// The "aio" section's keys, once ([Note: one list of the offload keys] in
// offload_options.h): X(name, its other spelling or "", in a DeepSpeed
// config too, least, most) for each AioOptions field (type and default are
// the TORCH_ARG's above; least and most bound integers where a config gives
// them, check_aio_options checks every source). use_io_uring is zeroshard's
// own (Python only); DeepSpeed's use_gds is read by the config reader alone,
// which flags it as unsupported.
#define ZEROSHARD_AIO_OPTIONS(X)                        \
  X(block_size, "", true, 4096, 0)                      \
  X(queue_depth, "", true, 1, 4096)                     \
  X(intra_op_parallelism, "thread_count", true, 1, 256) \
  X(single_submit, "", true, 0, 0)                      \
  X(overlap_events, "", true, 0, 0)                     \
  X(use_io_uring, "", false, 0, 0)

// What the list above says of one key; most 0: no upper bound.
struct AioOptionInfo {
  const char* name;
  const char* alias;
  bool in_config;
  int64_t least;
  int64_t most;
};

// Calls visit(info, value) for each AioOptions field, `value` a reference to
// the field (const when `options` is).
template <typename Options, typename Visitor>
void for_each_aio_option(Options& options, Visitor&& visit) {
#define ZEROSHARD_VISIT_AIO_OPTION(name, alias, in_config, least, most) \
  visit(AioOptionInfo{#name, alias, in_config, least, most}, options.name());
  ZEROSHARD_AIO_OPTIONS(ZEROSHARD_VISIT_AIO_OPTION)
#undef ZEROSHARD_VISIT_AIO_OPTION
}

// Buffer address, file offset and size multiple of IoFile's direct
// (O_DIRECT) path; the swap files lay their slots out on it.
constexpr int64_t kDirectIoAlignment = 4096;
// `bytes` rounded up to kDirectIoAlignment.
constexpr int64_t round_up_to_direct_io(int64_t bytes) {
  return (bytes + kDirectIoAlignment - 1) / kDirectIoAlignment * kDirectIoAlignment;
}

// Throws c10::ValueError naming the key for values out of range.
void check_aio_options(const AioOptions& options);

// One file, opened once. With Mode::kCreate the file is created (truncated)
// and `reserve_bytes` reserved with fallocate; a full disk is an error naming
// the path, the bytes asked for and the bytes free.
class IoFile {
 public:
  enum class Mode { kRead, kReadWrite, kCreate };

  static std::shared_ptr<IoFile> open(const std::string& path, Mode mode,
                                      int64_t reserve_bytes = 0);
  ~IoFile();
  IoFile(const IoFile&) = delete;
  IoFile& operator=(const IoFile&) = delete;

  const std::string& path() const { return path_; }
  // Whether aligned requests bypass the page cache.
  bool direct() const { return direct_fd_ >= 0; }
  // Buffer address, offset and size multiple that the direct path needs.
  int64_t alignment() const { return alignment_; }
  // The descriptor for a request (direct when it is aligned).
  int fd_for(const void* buffer, int64_t offset, int64_t bytes) const;
  // fsync: the written bytes are on the device.
  void sync() const;

 private:
  IoFile(std::string path, int buffered_fd, int direct_fd, int64_t alignment);

  std::string path_;
  int buffered_fd_ = -1;
  int direct_fd_ = -1;  // -1 when the file system refused O_DIRECT
  int64_t alignment_ = 4096;
};

enum class IoOp { kRead, kWrite };
const char* io_op_name(IoOp op);

struct IoRequest {
  IoFile* file = nullptr;
  IoOp op = IoOp::kRead;
  int64_t offset = 0;  // bytes into the file
  void* buffer = nullptr;
  int64_t bytes = 0;
};

using IoTicket = uint64_t;

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  // Queues the requests; returns at once.
  virtual IoTicket submit(std::vector<IoRequest> requests) = 0;
  // Waits until every request of `ticket` completed. Throws c10::Error naming
  // the file, the operation, the offset and the system's message for the
  // first that failed, and for a read that met the end of the file.
  virtual void wait(IoTicket ticket) = 0;
  // "io_uring" or "thread pool".
  virtual const char* backend() const = 0;

  // Telemetry, since construction.
  virtual int64_t bytes_read() const = 0;
  virtual int64_t bytes_written() const = 0;

  // submit + wait.
  void run(std::vector<IoRequest> requests) { wait(submit(std::move(requests))); }
};

// io_uring when it is built in, asked for and permitted; the thread pool
// otherwise, saying once why.
std::unique_ptr<IoEngine> make_io_engine(const AioOptions& options);
// The thread pool, whatever the system supports.
std::unique_ptr<IoEngine> make_thread_pool_io_engine(const AioOptions& options);
// io_uring; throws saying why where it is not built in or not permitted.
std::unique_ptr<IoEngine> make_io_uring_engine(const AioOptions& options);
// Whether make_io_uring_engine can succeed here (built in and permitted).
bool io_uring_available(std::string* why_not = nullptr);

}  // namespace zeroshard
