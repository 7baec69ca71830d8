// The NVMe tier's I/O engine alone, against both back ends: random offsets
// and sizes (not multiples of the block), unaligned caller buffers, many
// requests in flight, read-after-write, and the failures a disk gives (end of
// file, a full disk, a missing file, too little space), each an error naming
// the file and the operation.
#include "zeroshard/io_engine.h"

#include "temp_directory.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace zeroshard {
namespace {

std::unique_ptr<IoEngine> make_engine(const std::string& backend, AioOptions options) {
  return backend == "io_uring" ? make_io_uring_engine(options)
                               : make_thread_pool_io_engine(options.intra_op_parallelism(3));
}

class IoEngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string why_not;
    if (GetParam() == "io_uring" && !io_uring_available(&why_not)) {
      GTEST_SKIP() << "io_uring not available here: " << why_not;
    }
  }
  std::string path(const std::string& name) const { return dir_.path() + "/" + name; }

  TempDirectory dir_;
};

TEST_P(IoEngineTest, RandomUnalignedRequestsInFlightReadBackWhatWasWritten) {
  // Small pieces and a shallow queue, so requests are cut and queued.
  auto engine = make_engine(GetParam(), AioOptions().block_size(8192).queue_depth(4));
  EXPECT_STREQ(engine->backend(), GetParam() == "io_uring" ? "io_uring" : "thread pool");
  constexpr int64_t kFileBytes = 1 << 20;
  auto file = IoFile::open(path("swap"), IoFile::Mode::kCreate, kFileBytes);
  EXPECT_TRUE(file->direct()) << "the temporary directory's file system refuses O_DIRECT";

  std::mt19937_64 random(7);
  std::vector<char> shadow(kFileBytes, 0);
  // Non-overlapping ranges of random size and offset, written from buffers at
  // odd addresses, all in one ticket.
  std::vector<std::vector<char>> sources;
  std::vector<IoRequest> writes;
  for (int64_t at = 0; at + 30000 < kFileBytes;) {
    const int64_t gap = static_cast<int64_t>(random() % 5000);
    const int64_t bytes = 1 + static_cast<int64_t>(random() % 30000);
    const int64_t offset = at + gap;
    sources.emplace_back(bytes + 1);
    for (auto& c : sources.back()) {
      c = static_cast<char>(random());
    }
    std::memcpy(shadow.data() + offset, sources.back().data() + 1, bytes);
    writes.push_back({file.get(), IoOp::kWrite, offset, sources.back().data() + 1, bytes});
    at = offset + bytes;
  }
  // Plus aligned ones that take the direct path.
  alignas(4096) static char aligned[3 * 4096];
  for (size_t i = 0; i < sizeof(aligned); ++i) {
    aligned[i] = static_cast<char>(i * 31 + 5);
  }
  std::memcpy(shadow.data() + kFileBytes - sizeof(aligned), aligned, sizeof(aligned));
  writes.push_back({file.get(), IoOp::kWrite, kFileBytes - static_cast<int64_t>(sizeof(aligned)),
                    aligned, static_cast<int64_t>(sizeof(aligned))});
  ASSERT_GT(writes.size(), 40u);
  const IoTicket written = engine->submit(writes);
  engine->wait(written);
  engine->wait(written);  // a second wait returns at once

  // Random reads, unaligned and aligned, many in flight in two tickets.
  std::vector<std::vector<char>> targets;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::vector<IoRequest> first, second;
  for (int i = 0; i < 64; ++i) {
    const int64_t bytes = 1 + static_cast<int64_t>(random() % 40000);
    const int64_t offset = static_cast<int64_t>(random() % (kFileBytes - bytes));
    targets.emplace_back(bytes + 3);
    ranges.emplace_back(offset, bytes);
    (i % 2 ? first : second)
        .push_back({file.get(), IoOp::kRead, offset, targets.back().data() + 3, bytes});
  }
  alignas(4096) static char aligned_back[3 * 4096];
  second.push_back({file.get(), IoOp::kRead, kFileBytes - static_cast<int64_t>(sizeof(aligned)),
                    aligned_back, static_cast<int64_t>(sizeof(aligned_back))});
  const IoTicket a = engine->submit(first);
  const IoTicket b = engine->submit(second);
  engine->wait(b);
  engine->wait(a);
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto [offset, bytes] = ranges[i];
    ASSERT_EQ(std::memcmp(targets[i].data() + 3, shadow.data() + offset, bytes), 0)
        << "read " << i << " at " << offset << " (" << bytes << " bytes)";
  }
  EXPECT_EQ(std::memcmp(aligned_back, aligned, sizeof(aligned)), 0);
  int64_t expected_written = 0;
  for (const auto& w : writes) {
    expected_written += w.bytes;
  }
  EXPECT_EQ(engine->bytes_written(), expected_written);
  EXPECT_GT(engine->bytes_read(), 0);
}

TEST_P(IoEngineTest, ReadingPastTheEndOfTheFileNamesTheFileAndTheBytesMissing) {
  auto engine = make_engine(GetParam(), AioOptions());
  { std::ofstream(path("short")) << std::string(100, 'x'); }
  auto file = IoFile::open(path("short"), IoFile::Mode::kRead);
  std::vector<char> buffer(4096);
  try {
    engine->run({{file.get(), IoOp::kRead, 0, buffer.data(), 4096}});
    FAIL() << "a read past the end succeeded";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("read of 4096 bytes at offset 0 of '" + path("short") +
                           "' met the end of the file after 100 bytes"),
              std::string::npos)
        << message;
  }
  EXPECT_EQ(std::string(buffer.data(), 100), std::string(100, 'x'));
}

TEST_P(IoEngineTest, AFullDiskIsAnErrorNamingTheFileAndTheWrite) {
  auto engine = make_engine(GetParam(), AioOptions());
  auto file = IoFile::open("/dev/full", IoFile::Mode::kReadWrite);  // every write: ENOSPC
  std::vector<char> buffer(10000, 'y');
  try {
    engine->run({{file.get(), IoOp::kWrite, 0, buffer.data(), 10000}});
    FAIL() << "a write to a full disk succeeded";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("write of 10000 bytes at offset 0 of '/dev/full' failed: No space "
                           "left on device (the disk under nvme_path is full)"),
              std::string::npos)
        << message;
  }
  // The engine keeps working after a failed ticket.
  auto good = IoFile::open(path("after"), IoFile::Mode::kCreate, 4096);
  engine->run({{good.get(), IoOp::kWrite, 0, buffer.data(), 10}});
}

TEST_P(IoEngineTest, ABatchWithAnInvalidRequestRunsNothing) {
  auto engine = make_engine(GetParam(), AioOptions());
  auto file = IoFile::open(path("batch"), IoFile::Mode::kCreate, 8192);
  std::vector<char> buffer(4096, 'z');
  EXPECT_THROW(engine->submit({{file.get(), IoOp::kWrite, 0, buffer.data(), 4096},
                               {file.get(), IoOp::kWrite, -1, buffer.data(), 4096}}),
               c10::Error);
  std::vector<char> back(4096, 'a');
  engine->run({{file.get(), IoOp::kRead, 0, back.data(), 4096}});
  EXPECT_EQ(back, std::vector<char>(4096, '\0')) << "the valid half of a refused batch ran";
}

INSTANTIATE_TEST_SUITE_P(Backends, IoEngineTest, ::testing::Values("io_uring", "thread_pool"),
                         [](const auto& info) { return info.param; });

TEST(IoFile, AMissingFileOrTooLittleSpaceIsAnErrorNamingThePath) {
  TempDirectory temp;
  const std::string& dir = temp.path();
  try {
    IoFile::open(dir + "/removed", IoFile::Mode::kRead);
    FAIL() << "opened a missing file";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("cannot open '" + dir + "/removed' for reading: No such file"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  try {
    IoFile::open(dir + "/huge", IoFile::Mode::kCreate, int64_t{1} << 50);
    FAIL() << "reserved a petabyte";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("not enough free space for '" + dir + "/huge': it needs " +
                           std::to_string(int64_t{1} << 50) + " bytes"),
              std::string::npos)
        << message;
  }
  EXPECT_TRUE(temp.empty()) << "a file that could not be reserved was left behind";
}

TEST(IoEngine, RefusesOptionsOutOfRangeAndFallsBackToTheThreadPoolWhenAsked) {
  EXPECT_THROW(check_aio_options(AioOptions().block_size(1000)), c10::ValueError);
  EXPECT_THROW(check_aio_options(AioOptions().queue_depth(0)), c10::ValueError);
  EXPECT_THROW(check_aio_options(AioOptions().intra_op_parallelism(0)), c10::ValueError);
  EXPECT_THROW(check_aio_options(AioOptions().block_size(int64_t{1} << 32)), c10::ValueError)
      << "io_uring lengths are 32-bit";
  EXPECT_STREQ(make_io_engine(AioOptions().use_io_uring(false))->backend(), "thread pool");
  std::string why_not;
  const bool available = io_uring_available(&why_not);
  EXPECT_STREQ(make_io_engine(AioOptions())->backend(), available ? "io_uring" : "thread pool")
      << why_not;
}

}  // namespace
}  // namespace zeroshard
