// A fresh directory under the system's temporary directory, removed with its
// contents when the object goes. Removal uses nftw rather than
// std::filesystem::remove_all, whose copy exported by libtorch.so (the one
// these binaries bind to) crashes on a directory with contents.
#pragma once

#include <gtest/gtest.h>

#include <dirent.h>
#include <ftw.h>
#include <stdio.h>
#include <cstdlib>
#include <string>

namespace zeroshard {

class TempDirectory {
 public:
  TempDirectory() {
    const char* base = std::getenv("TMPDIR");
    path_ = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/zeroshard-XXXXXX";
    EXPECT_NE(::mkdtemp(path_.data()), nullptr) << path_;
  }
  ~TempDirectory() {
    ::nftw(
        path_.c_str(),
        [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  TempDirectory(const TempDirectory&) = delete;
  TempDirectory& operator=(const TempDirectory&) = delete;

  const std::string& path() const { return path_; }
  // Whether the directory holds nothing.
  bool empty() const {
    DIR* dir = ::opendir(path_.c_str());
    if (dir == nullptr) {
      return false;
    }
    int entries = 0;
    while (const dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      entries += name != "." && name != "..";
    }
    ::closedir(dir);
    return entries == 0;
  }

 private:
  std::string path_;
};

}  // namespace zeroshard
