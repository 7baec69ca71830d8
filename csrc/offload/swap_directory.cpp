#include "swap_directory.h"

#include <c10/util/Exception.h>

#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace zeroshard {

std::string make_swap_directory(const std::string& nvme_path, const std::string& prefix,
                                int64_t rank) {
  TORCH_CHECK_VALUE(!nvme_path.empty(),
                    "offload device 'nvme' needs nvme_path: a directory on the disk to swap to");
  struct stat info {};
  const bool exists = ::stat(nvme_path.c_str(), &info) == 0;
  TORCH_CHECK_VALUE(exists && S_ISDIR(info.st_mode), "nvme_path '", nvme_path,
                    "' is not an existing directory",
                    exists ? std::string() : std::string(" (") + std::strerror(errno) + ")");
  std::string pattern = nvme_path + "/" + prefix + "-rank" + std::to_string(rank) + "-XXXXXX";
  TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr,
              "cannot create a swap directory under nvme_path '", nvme_path,
              "': ", std::strerror(errno), " (is it writable by this user?)");
  return pattern;
}

void remove_swap_directory(std::string& directory, const std::string& file) noexcept {
  if (directory.empty()) {
    return;
  }
  ::unlink((directory + "/" + file).c_str());
  ::rmdir(directory.c_str());
  directory.clear();
}

}  // namespace zeroshard
