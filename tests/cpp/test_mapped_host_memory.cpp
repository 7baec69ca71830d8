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

TEST(MappedHostMemoryTest, SmallBuffersUseTheHeapAndAFreshMappingReadsAsZeros) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor small = empty_buffer(kMappedBufferBytes / 4 - 1, options);
  EXPECT_NE(small.storage().allocator(), mapped_host_allocator()) << "small blocks use the heap";
  at::Tensor fresh = empty_buffer(kMappedBufferBytes, options);
  EXPECT_EQ(fresh.storage().allocator(), mapped_host_allocator());
  EXPECT_EQ(fresh.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(empty_buffer(0, options).numel(), 0);
}

TEST(HostBufferPoolTest, AFreedBufferIsReused) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  constexpr int64_t kNumel = int64_t{1} << 20;
  HostBufferPool pool;
  void* first = nullptr;
  {
    at::Tensor buffer = pool.empty(kNumel, options);
    first = buffer.data_ptr();
    buffer.fill_(3);
  }
  EXPECT_EQ(pool.cached_bytes(), kNumel * 4);
  // A slightly smaller request (the next bucket) fits in the held mapping.
  at::Tensor again = pool.empty(kNumel - 1000, options);
  EXPECT_EQ(again.data_ptr(), first) << "the same mapping comes back";
  EXPECT_EQ(pool.cached_bytes(), 0);
  again = at::Tensor();
  {
    // Two out at once: the peak is 8 MiB.
    at::Tensor a = pool.empty(kNumel, options);
    at::Tensor b = pool.empty(kNumel, options);
  }
  // 6 MiB fits in neither held 4 MiB mapping; both go to keep the pool
  // within its peak, and the 6 MiB one is held when freed.
  pool.empty(kNumel * 3 / 2, options);
  EXPECT_EQ(pool.cached_bytes(), kNumel * 4 * 3 / 2);
  // A request of under half a held mapping does not pin it while a new
  // mapping fits within the peak beside it (6 + 1 + 1 MiB)...
  at::Tensor small = pool.empty(kNumel / 4, options);
  at::Tensor small2 = pool.empty(kNumel / 4, options);
  EXPECT_EQ(pool.cached_bytes(), kNumel * 4 * 3 / 2) << "the 6 MiB mapping is still held";
  // ...but when a new one would need room made by unmapping the held one,
  // the request takes it instead: the next 6 MiB request would only map it
  // again (a step's mix of bucket and shard sizes did that every step).
  at::Tensor small3 = pool.empty(kNumel / 4, options);
  EXPECT_EQ(pool.cached_bytes(), 0);
  EXPECT_EQ(small3.numel(), kNumel / 4);
  small3.fill_(1);
}

TEST(HostBufferPoolTest, ARecurringMixOfSizesStopsMappingAfterTheFirstStep) {
  // A step as the gradient path makes it: two buckets out at once, then a
  // shard-sized buffer (a quarter of a bucket). With the 2x rule alone the
  // small request unmapped a held bucket mapping (to stay within the peak)
  // and the next step's second bucket mapped it again: 2 fresh mappings a
  // step, for ever.
  const auto options = at::TensorOptions().dtype(at::kFloat);
  constexpr int64_t kBucket = int64_t{1} << 20;  // 4 MiB
  HostBufferPool pool;
  auto step = [&] {
    {
      at::Tensor first = pool.empty(kBucket, options).fill_(1);
      at::Tensor second = pool.empty(kBucket, options).fill_(1);
    }
    pool.empty(kBucket / 4, options).fill_(1);
  };
  step();
  const int64_t after_first_step = pool.mappings_made();
  EXPECT_LE(after_first_step, 3);
  for (int i = 0; i < 5; ++i) {
    step();
  }
  EXPECT_EQ(pool.mappings_made(), after_first_step) << "no fresh mapping after the first step";
  EXPECT_LE(pool.cached_bytes(), 2 * kBucket * 4) << "held within the peak";
}

TEST(HostBufferPoolTest, HoldsNoMoreThanItsPeakAndClearGivesItBack) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  constexpr int64_t kNumel = int64_t{1} << 20;  // 4 MiB
  HostBufferPool pool;
  const int64_t before = resident_bytes();
  {
    // Two out at once: the peak is 8 MiB.
    at::Tensor a = pool.empty(kNumel, options).fill_(1);
    at::Tensor b = pool.empty(kNumel, options).fill_(1);
  }
  EXPECT_EQ(pool.cached_bytes(), 2 * kNumel * 4);
  {
    // A size the pool does not hold: what it holds shrinks so that held plus
    // out stays within the 8 MiB peak.
    at::Tensor c = pool.empty(kNumel + 1024, options).fill_(1);
    EXPECT_LE(pool.cached_bytes() + (kNumel + 1024) * 4, 2 * kNumel * 4 + (kNumel + 1024) * 4);
    EXPECT_LE(pool.cached_bytes(), kNumel * 4);
  }
  const int64_t held = pool.cached_bytes();
  EXPECT_LE(held, 2 * kNumel * 4);
  EXPECT_GE(held, kNumel * 4);
  const int64_t resident_while_held = resident_bytes();
  EXPECT_GE(resident_while_held - before, kNumel * 4);  // held, resident
  pool.clear();
  EXPECT_EQ(pool.cached_bytes(), 0);
  EXPECT_GE(resident_while_held - resident_bytes(), held * 9 / 10) << "clear() unmaps";
  // Small and CUDA-less requests fall back to the heap, as empty_buffer does.
  EXPECT_NE(pool.empty(16, options).storage().allocator(), mapped_host_allocator());
}

TEST(HostBufferPoolTest, ABufferMayOutliveItsPool) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor survivor;
  {
    HostBufferPool pool;
    survivor = pool.empty(int64_t{1} << 20, options);
  }
  survivor.fill_(2);  // still mapped
  EXPECT_EQ(survivor.sum().item<float>(), 2.0f * (1 << 20));
  survivor = at::Tensor();  // unmapped now, without the pool
}

}  // namespace
}  // namespace zeroshard
