#include "durable_file.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace zeroshard::checkpoint_detail {
namespace {

std::string os_error() { return std::strerror(errno); }

}  // namespace

File File::create(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create checkpoint file ", path, ": ", os_error());
  return File(fd, path);
}

File File::open_for_reading(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK_VALUE(fd >= 0, "cannot open checkpoint file ", path, ": ", os_error());
  return File(fd, path);
}

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) {
      ::close(fd_);
    }
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

void File::write_all(const void* data, size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd_, bytes, size);
    if (written < 0 && errno == EINTR) {
      continue;
    }
    TORCH_CHECK(written > 0, "cannot write checkpoint file ", path_, ": ", os_error());
    bytes += written;
    size -= static_cast<size_t>(written);
  }
}

void File::read_at(int64_t offset, void* data, size_t size) const {
  auto* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = ::pread(fd_, bytes, size, offset);
    if (got < 0 && errno == EINTR) {
      continue;
    }
    TORCH_CHECK(got >= 0, "cannot read checkpoint file ", path_, ": ", os_error());
    TORCH_CHECK_VALUE(got > 0, "checkpoint file ", path_, " is truncated: it ends before byte ",
                      offset + static_cast<int64_t>(size));
    bytes += got;
    offset += got;
    size -= static_cast<size_t>(got);
  }
}

int64_t File::size() const {
  struct stat info {};
  TORCH_CHECK(::fstat(fd_, &info) == 0, "cannot stat ", path_, ": ", os_error());
  return static_cast<int64_t>(info.st_size);
}

void File::sync() {
  TORCH_CHECK(::fsync(fd_) == 0, "cannot fsync checkpoint file ", path_, ": ", os_error());
}

void File::close() {
  if (fd_ >= 0) {
    const int fd = std::exchange(fd_, -1);
    TORCH_CHECK(::close(fd) == 0, "cannot close checkpoint file ", path_, ": ", os_error());
  }
}

void fsync_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open directory ", path, ": ", os_error());
  const int rc = ::fsync(fd);
  const std::string error = rc == 0 ? "" : os_error();
  ::close(fd);
  TORCH_CHECK(rc == 0, "cannot fsync directory ", path, ": ", error);
}

void write_file_synced(const std::string& path, const std::string& content) {
  File file = File::create(path);
  file.write_all(content.data(), content.size());
  file.sync();
  file.close();
}

void replace_file_atomically(const std::string& path, const std::string& content) {
  const std::string temporary = path + ".tmp";
  write_file_synced(temporary, content);
  TORCH_CHECK(::rename(temporary.c_str(), path.c_str()) == 0, "cannot rename ", temporary, " to ",
              path, ": ", os_error());
  fsync_directory(parent_directory(path));
}

std::string read_whole_file(const std::string& path) {
  File file = File::open_for_reading(path);
  std::string content(static_cast<size_t>(file.size()), '\0');
  file.read_at(0, content.data(), content.size());
  return content;
}

void publish_directory(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  if (fs::exists(to)) {
#ifdef SYS_renameat2
    constexpr unsigned kRenameExchange = 1 << 1;  // RENAME_EXCHANGE
    if (::syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), kRenameExchange) ==
        0) {
      fsync_directory(parent_directory(to));
      remove_tree(from);  // `to` is published: a leftover old copy is harmless
      return;
    }
    // Only a kernel or file system without the exchange falls through.
    TORCH_CHECK(errno == EINVAL || errno == ENOSYS, "cannot exchange ", from, " with ", to, ": ",
                os_error());
#endif
    // No atomic exchange (old kernel or file system): move the old one aside
    // first; `to` is missing for an instant, never half-written.
    const std::string aside = to + ".replaced";
    std::string error;
    TORCH_CHECK(remove_tree(aside, &error), "cannot remove ", aside, ": ", error);
    fs::rename(to, aside);
    fs::rename(from, to);
    fsync_directory(parent_directory(to));
    remove_tree(aside);
    return;
  }
  TORCH_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename ", from, " to ", to, ": ",
              os_error());
  fsync_directory(parent_directory(to));
}

bool remove_tree(const std::string& path, std::string* error) {
  struct stat info {};
  if (::lstat(path.c_str(), &info) != 0) {
    return errno == ENOENT || (error != nullptr && (*error = os_error(), false));
  }
  // Depth first (FTW_DEPTH), not following links (FTW_PHYS): contents before
  // their directory, a link removed as a link.
  const int status = ::nftw(
      path.c_str(),
      [](const char* entry, const struct stat*, int, struct FTW*) { return ::remove(entry); }, 16,
      FTW_DEPTH | FTW_PHYS);
  if (status != 0) {
    if (error != nullptr) {
      *error = os_error();
    }
    return false;
  }
  return true;
}

std::string parent_directory(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::absolute(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace zeroshard::checkpoint_detail
