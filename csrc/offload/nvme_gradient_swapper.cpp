#include "zeroshard/nvme_gradient_swapper.h"

#include "swap_directory.h"
#include "zeroshard/mapped_host_memory.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>

namespace zeroshard {
namespace {

constexpr int64_t kAlignedElements = kDirectIoAlignment / 4;  // fp32 elements

constexpr const char* kSwapFileName = "gradients.swap";

}  // namespace

NvmeGradientSwapper::NvmeGradientSwapper(const OffloadOptions& offload, const AioOptions& aio,
                                         int64_t rank, std::vector<int64_t> numels,
                                         int64_t block_elements)
    : offload_(offload), block_elements_(block_elements), numels_(std::move(numels)) {
  TORCH_CHECK_VALUE(offload.buffer_count() >= 1,
                    "offload_optimizer.buffer_count must be >= 1, got ", offload.buffer_count());
  TORCH_INTERNAL_ASSERT(block_elements_ > 0 && block_elements_ % kAlignedElements == 0,
                        "gradient swap blocks must be whole multiples of the I/O alignment");
  check_aio_options(aio);
  for (int64_t numel : numels_) {
    offsets_.push_back(disk_bytes_);
    disk_bytes_ += round_up_to_direct_io(numel * 4);
    on_disk_.emplace_back((numel + block_elements_ - 1) / block_elements_, false);
    buffer_elements_ =
        std::max(buffer_elements_, round_up_to_direct_io(std::min(numel, block_elements_) * 4) / 4);
  }
  directory_ = make_swap_directory(offload.nvme_path(), "zeroshard-grads", rank);
  try {
    engine_ = make_io_engine(aio);
    file_ = IoFile::open(directory_ + "/" + kSwapFileName, IoFile::Mode::kCreate, disk_bytes_);
  } catch (...) {
    release_resources();
    throw;
  }
}

NvmeGradientSwapper::~NvmeGradientSwapper() { release_resources(); }

void NvmeGradientSwapper::release_resources() noexcept {
  // Writes in flight read their buffers: they finish before the buffers go.
  for (Draining& draining : draining_) {
    try {
      engine_->wait(draining.ticket);
    } catch (const std::exception&) {
      // Whoever waits for a write reports its failure; nobody will now.
    }
  }
  draining_.clear();
  engine_.reset();
  file_.reset();
  remove_swap_directory(directory_, kSwapFileName);
}

int64_t NvmeGradientSwapper::block_numel(size_t g, int64_t block) const {
  return std::min(block_elements_, numels_[g] - block * block_elements_);
}

int64_t NvmeGradientSwapper::block_bytes(size_t g, int64_t block) const {
  return round_up_to_direct_io(block_numel(g, block) * 4);
}

int64_t NvmeGradientSwapper::buffer_bytes() const {
  const auto buffers = static_cast<int64_t>(held_.size() + draining_.size() + pool_.size());
  return buffers * buffer_elements_ * 4;
}

void NvmeGradientSwapper::note_buffers() {
  peak_buffer_bytes_ = std::max(peak_buffer_bytes_, buffer_bytes());
}

at::Tensor NvmeGradientSwapper::take_buffer() {
  if (!pool_.empty()) {
    at::Tensor buffer = std::move(pool_.back());
    pool_.pop_back();
    return buffer;
  }
  // Page aligned (the direct path), and unmapped when the pool lets it go.
  return mapped_host_empty(buffer_elements_, at::kFloat);
}

void NvmeGradientSwapper::check_range(size_t g, int64_t offset, int64_t length) const {
  TORCH_INTERNAL_ASSERT(swaps(g) && offset >= 0 && length >= 0 && offset + length <= numels_[g],
                        "range [", offset, ", ", offset + length,
                        ") is outside the swapped gradient shard of group ", g);
}

template <typename F>
bool NvmeGradientSwapper::keep_failure(F&& io) {
  if (!failure_.empty()) {
    return false;
  }
  try {
    io();
    return true;
  } catch (const c10::Error& e) {
    failure_ = e.what_without_backtrace();
  } catch (const std::exception& e) {
    failure_ = e.what();
  }
  return false;
}

void NvmeGradientSwapper::wait(IoTicket ticket) {
  if (ticket == 0) {
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  engine_->wait(ticket);
  io_wait_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void NvmeGradientSwapper::wait_writes() {
  // Every write completes before the first failure is raised.
  std::exception_ptr failure;
  while (!draining_.empty()) {
    Draining oldest = std::move(draining_.front());
    draining_.pop_front();
    try {
      wait(oldest.ticket);
      pool_.push_back(std::move(oldest.values));
    } catch (...) {
      if (!failure) {
        failure = std::current_exception();
      }
    }
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
}

void NvmeGradientSwapper::write_block(const BlockId& id, HeldBlock block) {
  const auto max_draining = static_cast<size_t>(std::max<int64_t>(1, offload_.buffer_count()));
  while (draining_.size() >= max_draining) {
    Draining oldest = std::move(draining_.front());
    draining_.pop_front();
    wait(oldest.ticket);
    pool_.push_back(std::move(oldest.values));
  }
  const auto [g, k] = id;
  const IoTicket ticket = engine_->submit({{file_.get(), IoOp::kWrite, block_offset(g, k),
                                            block.values.data_ptr(), block_bytes(g, k)}});
  on_disk_[g][k] = true;
  draining_.push_back(Draining{std::move(block.values), ticket});
}

void NvmeGradientSwapper::accumulate(size_t g, int64_t offset, const at::Tensor& values) {
  const int64_t length = values.numel();
  check_range(g, offset, length);
  keep_failure([&] { accumulate_now(g, offset, values); });
}

void NvmeGradientSwapper::accumulate_now(size_t g, int64_t offset, const at::Tensor& values) {
  const int64_t length = values.numel();
  at::Tensor source = values.reshape({-1});
  if (!source.is_cpu()) {
    source = source.to(at::kCPU);
  }
  for_each_block_piece(g, offset, length,
                       [&](int64_t k, int64_t local, int64_t done, int64_t take) {
                         const BlockId id{g, k};
                         auto it = held_.find(id);
                         if (it == held_.end()) {
                           // On disk: a second round before the step, the block's sum so far.
                           HeldBlock block{load_block(g, k), 0};
                           it = held_.emplace(id, std::move(block)).first;
                           note_buffers();
                         }
                         HeldBlock& block = it->second;
                         block.values.narrow(0, local, take).add_(source.narrow(0, done, take));
                         block.arrived += take;
                         if (block.arrived == block_numel(g, k)) {
                           HeldBlock complete = std::move(block);
                           held_.erase(it);
                           write_block(id, std::move(complete));
                         }
                       });
}

template <typename F>
void NvmeGradientSwapper::for_each_block_piece(size_t g, int64_t offset, int64_t length,
                                               F&& fn) const {
  for (int64_t done = 0; done < length;) {
    const int64_t position = offset + done;
    const int64_t k = position / block_elements_;
    const int64_t local = position - k * block_elements_;
    const int64_t take = std::min(length - done, block_numel(g, k) - local);
    fn(k, local, done, take);
    done += take;
  }
}

at::Tensor NvmeGradientSwapper::load_block(size_t g, int64_t k) {
  at::Tensor block = take_buffer();
  if (on_disk_[g][k]) {
    wait_writes();  // its last write lands before it is read
    wait(engine_->submit(
        {{file_.get(), IoOp::kRead, block_offset(g, k), block.data_ptr(), block_bytes(g, k)}}));
  } else {
    block.zero_();  // nothing since clear(): zeros
  }
  return block;
}

void NvmeGradientSwapper::flush() {
  keep_failure([&] {
    while (!held_.empty()) {
      auto it = held_.begin();
      const BlockId id = it->first;
      HeldBlock block = std::move(it->second);
      held_.erase(it);
      write_block(id, std::move(block));
    }
    wait_writes();
  });
  // After a failure what is held or in flight is lost either way.
  for (auto& [id, block] : held_) {
    pool_.push_back(std::move(block.values));
  }
  held_.clear();
  drain_quietly();
  // What a round needs again next round; more would only sit in RSS.
  pool_.resize(std::min<size_t>(pool_.size(), static_cast<size_t>(offload_.buffer_count())));
}

void NvmeGradientSwapper::clear() {
  for (auto& [id, block] : held_) {
    pool_.push_back(std::move(block.values));
  }
  held_.clear();
  drain_quietly();  // the contents are being forgotten, failures with them
  for (auto& blocks : on_disk_) {
    std::fill(blocks.begin(), blocks.end(), false);
  }
  failure_.clear();
}

void NvmeGradientSwapper::drain_quietly() noexcept {
  // Every write is waited for, failed or not: its buffer is reused next.
  while (!draining_.empty()) {
    Draining oldest = std::move(draining_.front());
    draining_.pop_front();
    try {
      wait(oldest.ticket);
    } catch (const c10::Error& e) {
      failure_ = failure_.empty() ? e.what_without_backtrace() : failure_;
    } catch (const std::exception& e) {
      failure_ = failure_.empty() ? e.what() : failure_;
    }
    pool_.push_back(std::move(oldest.values));
  }
}

int64_t NvmeGradientSwapper::read_capacity(int64_t length) { return length + 2 * kAlignedElements; }

int64_t NvmeGradientSwapper::read_lead(int64_t offset) { return offset % kAlignedElements; }

IoTicket NvmeGradientSwapper::submit_read(size_t g, int64_t offset, int64_t length, float* buffer) {
  check_range(g, offset, length);
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(buffer) % kDirectIoAlignment == 0,
                        "gradient swap reads need a page-aligned buffer");
  flush();
  // The step reads through here and raises on every rank itself; a failure
  // kept from backward means the gradient is incomplete.
  TORCH_CHECK(failure_.empty(),
              "the gradient shard in the NVMe swap space is incomplete: ", failure_);
  // The aligned bytes around the range, so every piece takes the direct path.
  const int64_t begin = (offset - read_lead(offset)) * 4;
  const int64_t end = round_up_to_direct_io((offset + length) * 4);
  auto* out = reinterpret_cast<char*>(buffer);
  std::vector<IoRequest> reads;
  for (int64_t k = begin / (block_elements_ * 4); k * block_elements_ * 4 < end; ++k) {
    const int64_t block_begin = k * block_elements_ * 4;
    const int64_t lo = std::max(begin, block_begin);
    const int64_t hi = std::min(end, block_begin + block_bytes(g, k));
    if (on_disk_[g][k]) {
      reads.push_back({file_.get(), IoOp::kRead, offsets_[g] + lo, out + (lo - begin), hi - lo});
    } else {
      std::memset(out + (lo - begin), 0, hi - lo);  // nothing since clear(): zeros
    }
  }
  return reads.empty() ? 0 : engine_->submit(std::move(reads));
}

void NvmeGradientSwapper::wait_read(IoTicket ticket) { wait(ticket); }

at::Tensor NvmeGradientSwapper::read(size_t g, int64_t offset, int64_t length) {
  check_range(g, offset, length);
  at::Tensor buffer = mapped_host_empty(read_capacity(length), at::kFloat);
  if (!keep_failure([&] { wait_read(submit_read(g, offset, length, buffer.data_ptr<float>())); })) {
    buffer.zero_();
  }
  return buffer.narrow(0, read_lead(offset), length);
}

void NvmeGradientSwapper::write(size_t g, int64_t offset, const at::Tensor& values) {
  const int64_t length = values.numel();
  check_range(g, offset, length);
  flush();
  keep_failure([&] { write_now(g, offset, values); });
}

void NvmeGradientSwapper::write_now(size_t g, int64_t offset, const at::Tensor& values) {
  const int64_t length = values.numel();
  at::Tensor source = values.reshape({-1});
  for_each_block_piece(
      g, offset, length, [&](int64_t k, int64_t local, int64_t done, int64_t take) {
        // A whole block needs nothing read; a part keeps the rest of it.
        at::Tensor block = take < block_numel(g, k) ? load_block(g, k) : take_buffer();
        block.narrow(0, local, take).copy_(source.narrow(0, done, take));
        wait(engine_->submit({{file_.get(), IoOp::kWrite, block_offset(g, k), block.data_ptr(),
                               block_bytes(g, k)}}));
        on_disk_[g][k] = true;
        pool_.push_back(std::move(block));
      });
  note_buffers();
}

}  // namespace zeroshard
