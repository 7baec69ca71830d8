#include "zeroshard/io_engine.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>

namespace zeroshard {
namespace {

// Buffers, offsets and sizes that are multiples of this work with O_DIRECT on
// devices of 512-byte and 4 KiB logical blocks alike.
constexpr int64_t kDirectAlignment = kDirectIoAlignment;

std::string system_message(int error) { return std::strerror(error); }

int64_t free_bytes(const std::string& path) {
  struct statvfs info {};
  if (::statvfs(path.c_str(), &info) != 0) {
    return -1;
  }
  return static_cast<int64_t>(info.f_bavail) * static_cast<int64_t>(info.f_frsize);
}

}  // namespace

const char* io_op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

void check_aio_options(const AioOptions& options) {
  // At most 1 GiB: io_uring takes a 32-bit length per request.
  TORCH_CHECK_VALUE(options.block_size() >= kDirectAlignment &&
                        options.block_size() % kDirectAlignment == 0 &&
                        options.block_size() <= (int64_t{1} << 30),
                    "aio.block_size must be a multiple of ", kDirectAlignment,
                    " bytes between 4 KiB and 1 GiB, got ", options.block_size());
  TORCH_CHECK_VALUE(options.queue_depth() >= 1 && options.queue_depth() <= 4096,
                    "aio.queue_depth must be 1..4096, got ", options.queue_depth());
  TORCH_CHECK_VALUE(options.intra_op_parallelism() >= 1 && options.intra_op_parallelism() <= 256,
                    "aio.intra_op_parallelism must be 1..256, got ",
                    options.intra_op_parallelism());
}

IoFile::IoFile(std::string path, int buffered_fd, int direct_fd, int64_t alignment)
    : path_(std::move(path)),
      buffered_fd_(buffered_fd),
      direct_fd_(direct_fd),
      alignment_(alignment) {}

std::shared_ptr<IoFile> IoFile::open(const std::string& path, Mode mode, int64_t reserve_bytes) {
  int flags = O_CLOEXEC;
  const char* purpose = "reading";
  if (mode == Mode::kRead) {
    flags |= O_RDONLY;
  } else {
    flags |= O_RDWR;
    purpose = "reading and writing";
  }
  if (mode == Mode::kCreate) {
    flags |= O_CREAT | O_TRUNC;
    purpose = "creating";
  }
  const int buffered = ::open(path.c_str(), flags, 0600);
  TORCH_CHECK(buffered >= 0, "cannot open '", path, "' for ", purpose, ": ", system_message(errno));
  // The second descriptor must not truncate what the first one created.
  int direct = ::open(path.c_str(), (flags & ~(O_CREAT | O_TRUNC)) | O_DIRECT);
  if (direct < 0) {
    const int error = errno;
    // EINVAL is how a file system says it has no direct I/O (tmpfs); anything
    // else (no descriptors left, no memory) is an error of its own.
    if (error != EINVAL) {
      ::close(buffered);
      TORCH_CHECK(false, "cannot open '", path, "' for direct I/O: ", system_message(error));
    }
    TORCH_WARN_ONCE("zeroshard: the file system of '", path,
                    "' refuses O_DIRECT; NVMe swap I/O goes through the page cache there, which "
                    "is slower and uses host memory");
  }
  auto file = std::shared_ptr<IoFile>(new IoFile(path, buffered, direct, kDirectAlignment));
  if (mode == Mode::kCreate && reserve_bytes > 0) {
    // A file that could not be reserved is not left behind.
    struct RemoveUnlessReserved {
      const std::string& path;
      bool reserved = false;
      ~RemoveUnlessReserved() {
        if (!reserved) {
          ::unlink(path.c_str());
        }
      }
    } guard{path};
    // Checked first: a fallocate that runs out of space may allocate for a
    // long while before it fails.
    const int64_t available = free_bytes(path);
    TORCH_CHECK(available < 0 || reserve_bytes <= available, "not enough free space for '", path,
                "': it needs ", reserve_bytes, " bytes and the file system has ", available,
                " bytes free; point nvme_path at a larger disk or offload less");
    const std::string free_text =
        available < 0 ? "an unknown number of" : std::to_string(available);
    int error = ::fallocate(buffered, 0, 0, reserve_bytes) == 0 ? 0 : errno;
    if (error == EOPNOTSUPP) {
      error = ::posix_fallocate(buffered, 0, reserve_bytes);
    }
    TORCH_CHECK(error != ENOSPC, "not enough free space for '", path, "': it needs ", reserve_bytes,
                " bytes and the file system has ", free_text,
                " bytes free; point nvme_path at a larger disk or offload less");
    TORCH_CHECK(error == 0, "cannot reserve ", reserve_bytes, " bytes for '", path,
                "': ", system_message(error));
    guard.reserved = true;
  }
  return file;
}

IoFile::~IoFile() {
  if (direct_fd_ >= 0) {
    ::close(direct_fd_);
  }
  if (buffered_fd_ >= 0) {
    ::close(buffered_fd_);
  }
}

int IoFile::fd_for(const void* buffer, int64_t offset, int64_t bytes) const {
  const bool aligned = reinterpret_cast<uintptr_t>(buffer) % alignment_ == 0 &&
                       offset % alignment_ == 0 && bytes % alignment_ == 0;
  return aligned && direct_fd_ >= 0 ? direct_fd_ : buffered_fd_;
}

void IoFile::sync() const {
  TORCH_CHECK(::fsync(buffered_fd_) == 0, "fsync of '", path_, "' failed: ", system_message(errno));
}

}  // namespace zeroshard
