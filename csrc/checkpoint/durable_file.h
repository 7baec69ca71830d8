// Internal to csrc/checkpoint: files written so that a crash never leaves a
// checkpoint half-visible. Writes go to their final name inside a temporary
// directory and are fsynced; a directory becomes visible by one rename (an
// atomic exchange when it replaces an older one), and a small file is
// replaced by write-to-temp, fsync, rename, fsync of the directory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace zeroshard::checkpoint_detail {

// An open file descriptor; errors name the path and errno's message.
class File {
 public:
  static File create(const std::string& path);  // truncates
  static File open_for_reading(const std::string& path);
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  void write_all(const void* data, size_t size);
  // Reads exactly `size` bytes at `offset`; throws on a short read.
  void read_at(int64_t offset, void* data, size_t size) const;
  int64_t size() const;
  void sync();  // fsync
  void close();
  const std::string& path() const { return path_; }

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

void fsync_directory(const std::string& path);
// Writes `content` to `path` and fsyncs it (the directory is not synced).
void write_file_synced(const std::string& path, const std::string& content);
// Replaces `path` by `content` atomically: temp file, fsync, rename, fsync dir.
void replace_file_atomically(const std::string& path, const std::string& content);
std::string read_whole_file(const std::string& path);
// Makes directory `from` visible as `to`. If `to` exists it is exchanged
// atomically (renameat2 RENAME_EXCHANGE) and the old one removed, so `to`
// names a complete directory at every instant. Fsyncs the parent.
void publish_directory(const std::string& from, const std::string& to);
std::string parent_directory(const std::string& path);
// Removes `path` and, for a directory, everything under it (nothing if it
// does not exist); returns false and sets `error` on failure. Not
// std::filesystem::remove_all: the copy libtorch.so exports, which a binary
// loading libtorch binds to, crashes on a directory with contents (seen with
// torch 2.11: a null call inside it, on every checkpoint saved over another).
bool remove_tree(const std::string& path, std::string* error = nullptr);

}  // namespace zeroshard::checkpoint_detail
