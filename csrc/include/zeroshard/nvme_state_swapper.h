// The NVMe tier of the optimizer state (ZeRO-Infinity): the fp32 master and
// moments of the sub-groups StatePlacement puts on NVMe live in one swap file
// per rank, and come into host memory a few sub-groups at a time.
//
// Swap space: <nvme_path>/zeroshard-swap-rank<r>-XXXXXX/optimizer.swap (mkdtemp),
// reserved (fallocate) at construction for every state of every NVMe
// sub-group, and removed with its directory by the destructor (clean
// shutdown and error paths alike). Each sub-group has `states_per_sub_group`
// slots, each rounded up to the I/O alignment, so whole-slot transfers take
// the direct (O_DIRECT) path.
//
// [Note: NVMe step pipeline]
// The step visits its NVMe sub-groups in order through `buffer_count` host
// buffers (each holds every state of one sub-group). While sub-group i is
// updated, the reads of the next sub-groups are in flight and the writes of
// the previous ones drain: before i's update the read of i + L is issued,
// L = max(1, buffer_count - 2), into the buffer sub-group i + L - buffer_count
// last used, whose write had the updates in between to finish. pipeline_read
// = false reads each sub-group just before its update; pipeline_write = false
// waits for each write right after its update. Resident optimizer state is
// therefore at most buffer_count sub-groups, whatever the model size; the
// buffers are anonymous mappings, returned to the system when freed.
//
// Thread-safety: one caller at a time (the optimizer's step or a checkpoint).
#pragma once

#include "zeroshard/io_engine.h"
#include "zeroshard/offload_options.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

class NvmeStateSwapper {
 public:
  // `numels`: elements of each NVMe sub-group, in the order of the step.
  NvmeStateSwapper(const OffloadOptions& offload, const AioOptions& aio, int64_t rank,
                   std::vector<int64_t> numels, int64_t states_per_sub_group);
  ~NvmeStateSwapper();
  NvmeStateSwapper(const NvmeStateSwapper&) = delete;
  NvmeStateSwapper& operator=(const NvmeStateSwapper&) = delete;

  int64_t states_per_sub_group() const { return states_; }
  bool present(size_t sub_group, int64_t state) const { return present_[sub_group][state]; }

  // Synchronous access outside the step (initialization, checkpoints):
  // [local, local + length) of one state as an fp32 CPU tensor (zeros where
  // the state was never written), and a write of fp32 values there. Both
  // first wait for whatever a step left in flight.
  at::Tensor read(size_t sub_group, int64_t state, int64_t local, int64_t length);
  void write(size_t sub_group, int64_t state, int64_t local, const at::Tensor& values);
  // Makes a state present with zeros (a new moment) or absent (dropped).
  void mark_zero(size_t sub_group, int64_t state);
  void drop(size_t sub_group, int64_t state);

  // The step: begin() with the sub-groups to update in order; acquire(i)
  // waits for the i-th one's states and returns a 1D fp32 view per state
  // (undefined where not present); release(i) writes them back (states
  // marked in `now_present` become present); finish() waits for every
  // transfer, then raises the first failure; abandon() waits for every
  // transfer and drops their failures (a step unwinding from an exception).
  void begin(std::vector<size_t> order);
  std::vector<at::Tensor> acquire(size_t i);
  void release(size_t i, const std::vector<bool>& now_present);
  void finish();
  void abandon() noexcept;

  // Telemetry.
  int64_t disk_bytes() const { return disk_bytes_; }
  int64_t buffer_bytes() const;  // host memory of the step's buffers
  int64_t bytes_read() const { return engine_->bytes_read(); }
  int64_t bytes_written() const { return engine_->bytes_written(); }
  // Seconds the step spent waiting for reads or writes, since construction.
  double io_wait_seconds() const { return io_wait_seconds_; }
  const char* io_backend() const { return engine_->backend(); }
  const std::string& directory() const { return directory_; }

 private:
  struct Buffer {
    char* data = nullptr;
    int64_t bytes = 0;
    IoTicket read = 0;
    IoTicket write = 0;
  };

  int64_t slot_offset(size_t sub_group, int64_t state) const {
    return offsets_[sub_group] + state * slot_bytes_[sub_group];
  }
  Buffer& buffer_of(size_t i) { return buffers_[i % buffers_.size()]; }
  void issue_read(size_t i);
  void wait(IoTicket& ticket);
  // Waits for in-flight transfers, unmaps the buffers, removes the swap
  // directory. Safe to call twice.
  void release_resources();

  OffloadOptions offload_;
  int64_t states_;
  std::vector<int64_t> numels_;
  std::vector<int64_t> slot_bytes_;  // per sub-group: numel * 4 rounded up to the alignment
  std::vector<int64_t> offsets_;     // per sub-group: its first slot in the file
  std::vector<std::vector<bool>> present_;
  // Slots written since the reservation (unwritten ones read as zeros).
  std::vector<std::vector<bool>> ever_written_;
  int64_t disk_bytes_ = 0;
  std::string directory_;
  std::unique_ptr<IoEngine> engine_;
  std::shared_ptr<IoFile> file_;
  std::vector<Buffer> buffers_;
  int64_t buffer_stride_ = 0;  // bytes between a buffer's state slots
  std::vector<size_t> order_;
  size_t issued_ = 0;  // reads issued for order_[0, issued_)
  double io_wait_seconds_ = 0.0;
};

}  // namespace zeroshard
