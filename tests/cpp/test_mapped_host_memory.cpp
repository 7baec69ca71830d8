// The library's large short-lived CPU buffers are mappings of their own: the
// memory is in the process while a buffer lives and leaves it when the buffer
// goes, whatever glibc's mmap threshold has become.
#include "zeroshard/mapped_host_memory.h"

#include <ATen/ops/empty.h>
#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdio>

namespace zeroshard {
namespace {

int64_t resident_bytes() {
  long pages = 0;
  long resident = 0;
  FILE* statm = std::fopen("/proc/self/statm", "r");
  EXPECT_NE(statm, nullptr);
  EXPECT_EQ(std::fscanf(statm, "%ld %ld", &pages, &resident), 2);
  std::fclose(statm);
  return static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

TEST(MappedHostMemoryTest, AFreedBufferLeavesTheProcess) {
  constexpr int64_t kNumel = int64_t{4} << 20;  // 16 MiB of fp32
  // A freed 24 MiB heap block raises glibc's mmap threshold above 16 MiB, so
  // that a 16 MiB malloc would now stay in the heap once freed.
  at::empty({6 << 20}, at::kFloat).fill_(1);
  const int64_t before = resident_bytes();
  {
    at::Tensor buffer = empty_buffer(kNumel, at::TensorOptions().dtype(at::kFloat));
    EXPECT_EQ(buffer.storage().allocator(), mapped_host_allocator());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data_ptr()) % 4096, 0u);
    buffer.fill_(1);
    EXPECT_GE(resident_bytes() - before, kNumel * 4 * 9 / 10);
  }
  EXPECT_LE(resident_bytes() - before, int64_t{1} << 20);
}

TEST(MappedHostMemoryTest, SmallBuffersAndZerosBuffers) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor small = empty_buffer(kMappedBufferBytes / 4 - 1, options);
  EXPECT_NE(small.storage().allocator(), mapped_host_allocator()) << "small blocks use the heap";
  at::Tensor zeros = zeros_buffer(kMappedBufferBytes, options);
  EXPECT_EQ(zeros.storage().allocator(), mapped_host_allocator());
  EXPECT_EQ(zeros.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(empty_buffer(0, options).numel(), 0);
}

}  // namespace
}  // namespace zeroshard
