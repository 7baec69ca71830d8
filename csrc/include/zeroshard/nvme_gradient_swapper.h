// Gradient shards on NVMe (offload_optimizer.swap_gradients): with NVMe
// optimizer offload at stages 2 and 3 the rank's fp32 gradient shard lives
// in a swap file, written as its buckets are reduced during backward and
// read back a sub-group at a time by the step, so host memory holds a few
// blocks of it instead of the whole shard (DeepSpeed's ZeRO-Infinity swaps
// gradients out the same way).
//
// [Note: gradient swap blocks]
// Each swapped group's shard is cut into blocks of `block_elements` fp32
// elements at aligned file offsets. A reduced bucket slice is added into the
// in-memory copy of the blocks it touches; a block is written (one aligned,
// direct request) as soon as every element of it arrived in this round, and
// its memory goes back to a small pool. A backward round delivers every
// element of the shard exactly once (GradientBuckets launches every bucket
// once a round), so blocks complete as the buckets do, and only the blocks
// straddling a bucket still in flight are held, plus up to buffer_count
// writes draining. A second round before the step (gradient accumulation)
// reads each block back before adding into it. clear() forgets the contents
// without I/O: blocks not written since read as zeros.
//
// Swap space: <nvme_path>/zeroshard-grads-rank<r>-XXXXXX/gradients.swap,
// reserved at construction and removed by the destructor.
//
// I/O failures outside the step's reads (during backward, in the norm) do
// not throw: they run inside autograd hooks and between collectives, where
// raising on one rank would leave the others waiting. The first is kept
// (failure()), later I/O is skipped and reads give zeros, and the optimizer
// raises it on every rank at its next agreement point (the step, the norm).
//
// Thread-safety: one caller at a time (the optimizer holds its mutex).
#pragma once

#include "zeroshard/io_engine.h"
#include "zeroshard/offload_options.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

// 4 MiB blocks: large enough for the disk's full bandwidth, small enough that
// the few held at once are noise next to the shard.
constexpr int64_t kGradientSwapBlockElements = int64_t{1} << 20;

class NvmeGradientSwapper {
 public:
  // `numels[g]`: elements of group g's gradient shard swapped (0: group g's
  // shard is not swapped).
  NvmeGradientSwapper(const OffloadOptions& offload, const AioOptions& aio, int64_t rank,
                      std::vector<int64_t> numels,
                      int64_t block_elements = kGradientSwapBlockElements);
  ~NvmeGradientSwapper();
  NvmeGradientSwapper(const NvmeGradientSwapper&) = delete;
  NvmeGradientSwapper& operator=(const NvmeGradientSwapper&) = delete;

  bool swaps(size_t group) const { return group < numels_.size() && numels_[group] > 0; }
  int64_t numel(size_t group) const { return numels_.at(group); }

  // Adds `values` (1D, any floating dtype and device) into [offset, offset +
  // values.numel()) of group `group`'s shard. Within a round each element is
  // added once (see [Note: gradient swap blocks]).
  void accumulate(size_t group, int64_t offset, const at::Tensor& values);
  // Ends a round: waits for every write. Every block touched this round is
  // complete by then; one that is not (a round cut short by an exception)
  // is written as it is.
  void flush();
  // Zero gradients: forgets the contents and a kept failure, with no I/O.
  void clear();
  // The first I/O failure since clear() (file, operation, offset, reason),
  // or empty.
  const std::string& failure() const { return failure_; }

  // The step's read of [offset, offset + length) of group `group` in fp32:
  // starts the read into `buffer` (page aligned, at least
  // read_capacity(length) elements) and returns its ticket; the values start
  // at buffer + read_lead(offset). wait_read() waits for it.
  static int64_t read_capacity(int64_t length);
  static int64_t read_lead(int64_t offset);
  IoTicket submit_read(size_t group, int64_t offset, int64_t length, float* buffer);
  void wait_read(IoTicket ticket);

  // Synchronous access (norm, overflow check, replica reduction): a copy of
  // [offset, offset + length) in fp32 (zeros after a failure), and an
  // overwrite of that range. Failures are kept, not thrown.
  at::Tensor read(size_t group, int64_t offset, int64_t length);
  void write(size_t group, int64_t offset, const at::Tensor& values);

  // Telemetry.
  int64_t disk_bytes() const { return disk_bytes_; }
  // Host memory its block buffers hold now (held blocks, draining writes,
  // the pool).
  int64_t buffer_bytes() const;
  // The most buffer_bytes() ever held.
  int64_t peak_buffer_bytes() const { return peak_buffer_bytes_; }
  int64_t bytes_read() const { return engine_->bytes_read(); }
  int64_t bytes_written() const { return engine_->bytes_written(); }
  double io_wait_seconds() const { return io_wait_seconds_; }
  const std::string& directory() const { return directory_; }

 private:
  struct HeldBlock {
    at::Tensor values;  // fp32, block_elements_ (page aligned)
    int64_t arrived = 0;
  };
  struct Draining {
    at::Tensor values;
    IoTicket ticket = 0;
  };
  using BlockId = std::pair<size_t, int64_t>;  // group, block index

  int64_t blocks_of(size_t group) const {
    return (numels_[group] + block_elements_ - 1) / block_elements_;
  }
  int64_t block_numel(size_t group, int64_t block) const;
  int64_t block_offset(size_t group, int64_t block) const {  // bytes into the file
    return offsets_[group] + block * block_elements_ * 4;
  }
  int64_t block_bytes(size_t group, int64_t block) const;
  at::Tensor take_buffer();
  // Calls fn(block, offset in it, offset in the range, length) for each
  // block piece of [offset, offset + length) of group `group`.
  template <typename F>
  void for_each_block_piece(size_t group, int64_t offset, int64_t length, F&& fn) const;
  // A pool buffer holding block `block`'s contents so far (zeros where
  // nothing was written since clear()).
  at::Tensor load_block(size_t group, int64_t block);
  void accumulate_now(size_t group, int64_t offset, const at::Tensor& values);
  void write_now(size_t group, int64_t offset, const at::Tensor& values);
  // Waits for every write, keeping the first failure.
  void drain_quietly() noexcept;
  void write_block(const BlockId& id, HeldBlock block);
  void wait(IoTicket ticket);
  void wait_writes();
  void note_buffers();
  void check_range(size_t group, int64_t offset, int64_t length) const;
  void release_resources() noexcept;
  // Runs `io`; keeps the first failure instead of throwing. False when it
  // failed now or earlier (the caller then skips its I/O).
  template <typename F>
  bool keep_failure(F&& io);

  OffloadOptions offload_;
  int64_t block_elements_;
  std::vector<int64_t> numels_;
  std::vector<int64_t> offsets_;            // per group: its first byte in the file
  std::vector<std::vector<bool>> on_disk_;  // per block: written since clear()
  std::map<BlockId, HeldBlock> held_;
  std::deque<Draining> draining_;
  std::vector<at::Tensor> pool_;
  int64_t buffer_elements_ = 0;
  int64_t peak_buffer_bytes_ = 0;
  int64_t disk_bytes_ = 0;
  std::string directory_;
  std::unique_ptr<IoEngine> engine_;
  std::shared_ptr<IoFile> file_;
  double io_wait_seconds_ = 0.0;
  std::string failure_;
};

}  // namespace zeroshard
