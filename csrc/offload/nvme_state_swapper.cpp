#include "zeroshard/nvme_state_swapper.h"

#include "swap_directory.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>

namespace zeroshard {
namespace {

int64_t round_up(int64_t bytes) { return round_up_to_direct_io(bytes); }

constexpr const char* kSwapFileName = "optimizer.swap";
std::string swap_file(const std::string& directory) { return directory + "/" + kSwapFileName; }

}  // namespace

NvmeStateSwapper::NvmeStateSwapper(const OffloadOptions& offload, const AioOptions& aio,
                                   int64_t rank, std::vector<int64_t> numels,
                                   int64_t states_per_sub_group)
    : offload_(offload), states_(states_per_sub_group), numels_(std::move(numels)) {
  TORCH_CHECK_VALUE(offload.buffer_count() >= 1,
                    "offload_optimizer.buffer_count must be >= 1, got ", offload.buffer_count());
  check_aio_options(aio);
  int64_t largest_slot = 0;
  for (int64_t numel : numels_) {
    slot_bytes_.push_back(round_up(numel * static_cast<int64_t>(sizeof(float))));
    offsets_.push_back(disk_bytes_);
    disk_bytes_ += states_ * slot_bytes_.back();
    largest_slot = std::max(largest_slot, slot_bytes_.back());
    present_.emplace_back(states_, false);
  }
  ever_written_ = present_;
  directory_ = make_swap_directory(offload.nvme_path(), "zeroshard-swap", rank);
  try {
    engine_ = make_io_engine(aio);
    file_ = IoFile::open(swap_file(directory_), IoFile::Mode::kCreate, disk_bytes_);
    const auto count = static_cast<size_t>(std::min<int64_t>(
        offload.buffer_count(), std::max<int64_t>(1, static_cast<int64_t>(numels_.size()))));
    buffer_stride_ = largest_slot;
    for (size_t b = 0; b < count && largest_slot > 0; ++b) {
      const int64_t bytes = states_ * largest_slot;
      void* memory =
          ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TORCH_CHECK(memory != MAP_FAILED, "cannot map ", bytes,
                  " bytes of host memory for the NVMe "
                  "swap buffers (buffer_count ",
                  offload.buffer_count(), "): ", std::strerror(errno));
      buffers_.push_back(Buffer{static_cast<char*>(memory), bytes, 0, 0});
    }
  } catch (...) {
    release_resources();
    throw;
  }
}

NvmeStateSwapper::~NvmeStateSwapper() { release_resources(); }

void NvmeStateSwapper::release_resources() {
  // In-flight transfers target the buffers: they finish before the unmap.
  for (Buffer& buffer : buffers_) {
    for (IoTicket* ticket : {&buffer.read, &buffer.write}) {
      try {
        if (engine_ && *ticket != 0) {
          engine_->wait(*ticket);
        }
      } catch (const std::exception&) {
        // The step that issued it reported (or will never report) the failure.
      }
      *ticket = 0;
    }
  }
  engine_.reset();
  for (Buffer& buffer : buffers_) {
    ::munmap(buffer.data, buffer.bytes);
  }
  buffers_.clear();
  file_.reset();
  remove_swap_directory(directory_, kSwapFileName);
}

int64_t NvmeStateSwapper::buffer_bytes() const {
  int64_t total = 0;
  for (const Buffer& buffer : buffers_) {
    total += buffer.bytes;
  }
  return total;
}

at::Tensor NvmeStateSwapper::read(size_t j, int64_t state, int64_t local, int64_t length) {
  TORCH_INTERNAL_ASSERT(local >= 0 && local + length <= numels_.at(j) && state >= 0 &&
                        state < states_);
  finish();  // nothing of a step may still be in flight
  at::Tensor out = at::zeros({length}, at::kFloat);
  if (!present_[j][state] || length == 0) {
    return out;
  }
  if (local == 0 && length == numels_[j] && !buffers_.empty()) {
    // A whole slot: through an aligned buffer, so it takes the direct path and
    // the swap does not pass through the page cache.
    engine_->run(
        {{file_.get(), IoOp::kRead, slot_offset(j, state), buffers_[0].data, slot_bytes_[j]}});
    std::memcpy(out.data_ptr(), buffers_[0].data, length * 4);
    return out;
  }
  engine_->run(
      {{file_.get(), IoOp::kRead, slot_offset(j, state) + local * 4, out.data_ptr(), length * 4}});
  return out;
}

void NvmeStateSwapper::write(size_t j, int64_t state, int64_t local, const at::Tensor& values) {
  const at::Tensor source = values.to(at::kCPU, at::kFloat).contiguous();
  const int64_t length = source.numel();
  TORCH_INTERNAL_ASSERT(local >= 0 && local + length <= numels_.at(j) && state >= 0 &&
                        state < states_);
  finish();  // a write-behind of the same slot must not land after this one
  if (!present_[j][state] && ever_written_[j][state] && length < numels_[j]) {
    // What a partial write leaves untouched must read as zeros, as a new state does.
    write(j, state, 0, at::zeros({numels_[j]}, at::kFloat));
  }
  if (local == 0 && length == numels_[j] && length > 0 && !buffers_.empty()) {
    // A whole slot: through an aligned buffer (the direct path), padding zeroed.
    std::memcpy(buffers_[0].data, source.data_ptr(), length * 4);
    std::memset(buffers_[0].data + length * 4, 0, slot_bytes_[j] - length * 4);
    engine_->run(
        {{file_.get(), IoOp::kWrite, slot_offset(j, state), buffers_[0].data, slot_bytes_[j]}});
  } else if (length > 0) {
    engine_->run({{file_.get(), IoOp::kWrite, slot_offset(j, state) + local * 4, source.data_ptr(),
                   length * 4}});
  }
  present_[j][state] = true;
  ever_written_[j][state] = true;
}

void NvmeStateSwapper::mark_zero(size_t j, int64_t state) {
  if (ever_written_[j][state]) {
    write(j, state, 0, at::zeros({numels_[j]}, at::kFloat));
  }
  present_[j][state] = true;  // a reserved, never written range reads as zeros
}

void NvmeStateSwapper::drop(size_t j, int64_t state) { present_[j][state] = false; }

void NvmeStateSwapper::wait(IoTicket& ticket) {
  if (ticket == 0) {
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  const IoTicket waited = ticket;
  ticket = 0;
  engine_->wait(waited);
  io_wait_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void NvmeStateSwapper::begin(std::vector<size_t> order) {
  finish();
  order_ = std::move(order);
  issued_ = 0;
}

void NvmeStateSwapper::issue_read(size_t i) {
  Buffer& buffer = buffer_of(i);
  wait(buffer.write);  // the buffer's previous sub-group is on disk
  const size_t j = order_[i];
  std::vector<IoRequest> reads;
  for (int64_t s = 0; s < states_; ++s) {
    if (present_[j][s]) {
      reads.push_back({file_.get(), IoOp::kRead, slot_offset(j, s),
                       buffer.data + s * buffer_stride_, slot_bytes_[j]});
    }
  }
  buffer.read = engine_->submit(std::move(reads));
}

std::vector<at::Tensor> NvmeStateSwapper::acquire(size_t i) {
  TORCH_INTERNAL_ASSERT(i < order_.size() && !buffers_.empty());
  // See [Note: NVMe step pipeline].
  const size_t ahead = offload_.pipeline_read()
                           ? std::max<size_t>(1, buffers_.size() > 2 ? buffers_.size() - 2 : 1)
                           : 0;
  const size_t until = std::min(order_.size(), i + 1 + (buffers_.size() > 1 ? ahead : 0));
  while (issued_ < until) {
    issue_read(issued_++);
  }
  Buffer& buffer = buffer_of(i);
  wait(buffer.read);
  const size_t j = order_[i];
  std::vector<at::Tensor> views(states_);
  for (int64_t s = 0; s < states_; ++s) {
    if (present_[j][s]) {
      views[s] = at::from_blob(buffer.data + s * buffer_stride_, {numels_[j]}, at::kFloat);
    }
  }
  return views;
}

void NvmeStateSwapper::release(size_t i, const std::vector<bool>& now_present) {
  Buffer& buffer = buffer_of(i);
  const size_t j = order_[i];
  std::vector<IoRequest> writes;
  for (int64_t s = 0; s < states_; ++s) {
    if (now_present[s]) {
      writes.push_back({file_.get(), IoOp::kWrite, slot_offset(j, s),
                        buffer.data + s * buffer_stride_, slot_bytes_[j]});
      present_[j][s] = true;
      ever_written_[j][s] = true;
    }
  }
  buffer.write = engine_->submit(std::move(writes));
  if (!offload_.pipeline_write()) {
    wait(buffer.write);
  }
}

void NvmeStateSwapper::finish() {
  // Every transfer completes before the first failure is raised, so none is
  // left in flight behind an error.
  std::exception_ptr failure;
  for (Buffer& buffer : buffers_) {
    for (IoTicket* ticket : {&buffer.read, &buffer.write}) {
      try {
        wait(*ticket);
      } catch (...) {
        if (!failure) {
          failure = std::current_exception();
        }
      }
    }
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
}

void NvmeStateSwapper::abandon() noexcept {
  for (Buffer& buffer : buffers_) {
    for (IoTicket* ticket : {&buffer.read, &buffer.write}) {
      try {
        wait(*ticket);
      } catch (...) {
        // The step that raised reports its own failure.
      }
    }
  }
}

}  // namespace zeroshard
