// The NVMe tier of stage-3 parameter shards (offload_param.device = 'nvme',
// ZeRO-Infinity): this rank's shard of each bucket of the partition layout
// (one unit's parameters of one group) lives in a swap file and is read just
// ahead of the all-gather that needs it.
//
// Swap space: <nvme_path>/zeroshard-params-rank<r>-XXXXXX/parameters.swap
// (mkdtemp), reserved (fallocate) at construction, removed with its directory
// by the destructor. Each bucket's slot holds its shard in the parameters'
// dtype, rounded up to 4 KiB, so every transfer is a whole aligned slot and
// takes the direct (O_DIRECT) path.
//
// DeepSpeed's max_in_cpu: the first buckets in layout order, up to max_in_cpu
// elements in all, stay in host memory instead. Persistent buckets (gathered
// once and kept: parameters below stage3_param_persistence_threshold) stay in
// host memory too.
//
// [Note: parameter read-ahead]
// An iteration's gathers ask for the buckets in the order the previous one
// did (the gatherer's prefetch plan follows the same order, one level up).
// The swapper records the order of read() calls between two end_iteration()
// calls (the step) and, while the current iteration follows it (a read found
// next in line, or a few places further on), keeps the reads of the next
// planned NVMe buckets in flight (from the step on, for the first ones), at
// most buffer_count of them, each in
// a buffer of its own (offload_param.buffer_size elements at most). A write
// to a bucket (the step, initialization) first cancels its read-ahead, so a
// read never returns values older than the last write. Host memory for
// NVMe-resident shards is therefore at most buffer_count buckets ahead plus
// the buckets whose all-gathers are in flight; every buffer is an anonymous
// mapping that goes back to the system when released (mapped_host_memory.h).
//
// Thread-safety: one caller at a time (ZeroOptimizer serialises the gathers
// of the training and backward threads and its step with its mutex).
#pragma once

#include "zeroshard/io_engine.h"
#include "zeroshard/offload_options.h"
#include "zeroshard/partition_layout.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

class NvmeParameterSwapper {
 public:
  // `dtypes`: the parameters' dtype of each group of `layout`.
  NvmeParameterSwapper(const PartitionLayout& layout, std::vector<c10::ScalarType> dtypes,
                       const OffloadOptions& offload_param, const AioOptions& aio, int64_t rank);
  ~NvmeParameterSwapper();
  NvmeParameterSwapper(const NvmeParameterSwapper&) = delete;
  NvmeParameterSwapper& operator=(const NvmeParameterSwapper&) = delete;

  bool on_nvme(size_t group, size_t bucket) const { return slots_[group][bucket].on_nvme; }

  // This rank's shard of bucket (group, bucket), 1D in the group's dtype, on
  // the host. For an NVMe bucket the tensor is the caller's to keep (its
  // buffer is freed with it); for a host bucket it is the stored shard itself.
  at::Tensor read(size_t group, size_t bucket);
  // Writes `values` to [offset, offset + numel) of the group's shard (shard
  // coordinates; the range may span buckets and cut them). A bucket written
  // in pieces reaches the disk once, when complete or at the next flush()
  // (see [Note: coalesced parameter writes] in the .cpp); reads see it either way.
  void write(size_t group, int64_t offset, const at::Tensor& values);
  // Writes the bucket still being assembled, if any (the step calls it
  // last, so that its failures are the step's).
  void flush();
  // After the step: the reads since the last call become the read-ahead
  // plan of the next iteration, whose first reads start now (reads still
  // ahead from this iteration are dropped).
  void end_iteration();

  // Telemetry.
  int64_t disk_bytes() const { return disk_bytes_; }
  // Shards kept in host memory (max_in_cpu and persistent buckets).
  int64_t host_shard_bytes() const { return host_shard_bytes_; }
  // Read-ahead buffers held now, and the most held at once.
  int64_t ahead_bytes() const { return ahead_bytes_; }
  int64_t peak_ahead_bytes() const { return peak_ahead_bytes_; }
  int64_t bytes_read() const { return engine_->bytes_read(); }
  int64_t bytes_written() const { return engine_->bytes_written(); }
  // Reads served from the read-ahead, and reads that waited for the disk
  // on demand (the plan did not foresee them).
  int64_t reads_ahead() const { return reads_ahead_; }
  int64_t reads_on_demand() const { return reads_on_demand_; }
  // Seconds spent waiting for reads or writes, since construction.
  double io_wait_seconds() const { return io_wait_seconds_; }
  const char* io_backend() const { return engine_->backend(); }
  const std::string& directory() const { return directory_; }

 private:
  using BucketId = std::pair<size_t, size_t>;
  struct Slot {
    bool on_nvme = false;
    int64_t numel = 0;         // this rank's shard of the bucket
    int64_t shard_offset = 0;  // in the group's shard
    int64_t file_offset = 0;   // NVMe: where the slot starts
    int64_t slot_bytes = 0;    // NVMe: numel * element size, rounded up to 4 KiB
    at::Tensor host;           // host buckets: the shard
  };
  struct Ahead {
    at::Tensor buffer;
    IoTicket ticket = 0;
  };
  struct Pending {
    size_t group = 0;
    size_t bucket = 0;
    at::Tensor buffer;    // the whole slot
    int64_t covered = 0;  // [0, covered) written, unless merged
    bool merged = false;  // holds the stored values everywhere else
  };

  at::Tensor new_buffer(const Slot& slot, size_t group) const;
  IoTicket submit(IoOp op, const Slot& slot, const at::Tensor& buffer);
  void wait(IoTicket ticket);
  void cancel_ahead(const BucketId& id);
  void issue_ahead() noexcept;
  void write_slot(size_t group, size_t bucket, int64_t begin, const at::Tensor& values);
  void merge_stored_values();
  void release_resources() noexcept;

  OffloadOptions offload_;
  std::vector<c10::ScalarType> dtypes_;
  std::vector<std::vector<Slot>> slots_;
  int64_t disk_bytes_ = 0;
  int64_t host_shard_bytes_ = 0;
  std::string directory_;
  std::unique_ptr<IoEngine> engine_;
  std::shared_ptr<IoFile> file_;
  std::map<BucketId, Ahead> ahead_;
  std::optional<Pending> pending_;
  int64_t ahead_bytes_ = 0;
  int64_t peak_ahead_bytes_ = 0;
  std::vector<BucketId> plan_;   // the previous iteration's reads
  std::vector<BucketId> trace_;  // this iteration's
  size_t cursor_ = 0;            // how far this iteration followed plan_
  bool following_ = false;
  int64_t reads_ahead_ = 0;
  int64_t reads_on_demand_ = 0;
  double io_wait_seconds_ = 0.0;
};

}  // namespace zeroshard
