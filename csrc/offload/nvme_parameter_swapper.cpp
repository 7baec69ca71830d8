#include "zeroshard/nvme_parameter_swapper.h"

#include "swap_directory.h"
#include "zeroshard/mapped_host_memory.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <exception>

namespace zeroshard {
namespace {

// A run that never steps (evaluation only) stops recording its reads here.
constexpr size_t kMaxTrace = size_t{1} << 20;
// How far ahead in the plan a read that is not next in line is looked for.
constexpr size_t kResyncWindow = 8;

int64_t round_up(int64_t bytes) { return round_up_to_direct_io(bytes); }

constexpr const char* kSwapFileName = "parameters.swap";
std::string swap_file(const std::string& directory) { return directory + "/" + kSwapFileName; }

}  // namespace

NvmeParameterSwapper::NvmeParameterSwapper(const PartitionLayout& layout,
                                           std::vector<c10::ScalarType> dtypes,
                                           const OffloadOptions& offload_param,
                                           const AioOptions& aio, int64_t rank)
    : offload_(offload_param), dtypes_(std::move(dtypes)) {
  TORCH_CHECK_VALUE(offload_.buffer_count() >= 1,
                    "offload_param.buffer_count must be >= 1 (the buckets read ahead), got ",
                    offload_.buffer_count());
  TORCH_CHECK_VALUE(offload_.buffer_size() >= 1,
                    "offload_param.buffer_size must be >= 1 element, got ", offload_.buffer_size());
  TORCH_INTERNAL_ASSERT(dtypes_.size() == layout.groups().size());
  check_aio_options(aio);
  int64_t in_cpu_left = offload_.max_in_cpu();
  bool spilled = false;  // max_in_cpu keeps a prefix of the layout
  slots_.resize(dtypes_.size());
  for (size_t g = 0; g < dtypes_.size(); ++g) {
    const int64_t element = static_cast<int64_t>(c10::elementSize(dtypes_[g]));
    for (size_t b = 0; b < layout.group(g).buckets().size(); ++b) {
      const Bucket& bucket = layout.group(g).buckets()[b];
      Slot slot;
      slot.numel = bucket.shard_numel;
      slot.shard_offset = bucket.shard_offset;
      const bool persistent = bucket.unit == kNoUnit;
      if (!persistent && !spilled && slot.numel <= in_cpu_left) {
        in_cpu_left -= slot.numel;
      } else if (!persistent) {
        spilled = true;
        slot.on_nvme = true;
      }
      if (slot.on_nvme) {
        TORCH_CHECK_VALUE(slot.numel <= offload_.buffer_size(), "offload_param.buffer_size (",
                          offload_.buffer_size(), " elements) is smaller than this rank's shard ",
                          "of bucket ", b, " of parameter group ", g, " (", slot.numel,
                          " elements); raise buffer_size to at least ", slot.numel,
                          " (each bucket is read into one buffer, as in DeepSpeed)");
        slot.slot_bytes = round_up(slot.numel * element);
        slot.file_offset = disk_bytes_;
        disk_bytes_ += slot.slot_bytes;
      } else {
        slot.host = at::zeros({slot.numel}, at::TensorOptions().dtype(dtypes_[g]));
        host_shard_bytes_ += slot.numel * element;
      }
      slots_[g].push_back(std::move(slot));
    }
  }
  directory_ = make_swap_directory(offload_.nvme_path(), "zeroshard-params", rank);
  try {
    engine_ = make_io_engine(aio);
    file_ = IoFile::open(swap_file(directory_), IoFile::Mode::kCreate, disk_bytes_);
  } catch (...) {
    release_resources();
    throw;
  }
}

NvmeParameterSwapper::~NvmeParameterSwapper() { release_resources(); }

void NvmeParameterSwapper::release_resources() noexcept {
  try {
    flush();
  } catch (const std::exception&) {
    // Going away: nobody reads these values again.
  }
  // Reads in flight target the buffers: they finish before the buffers go.
  for (auto& [id, ahead] : ahead_) {
    try {
      engine_->wait(ahead.ticket);
    } catch (const std::exception&) {
      // A read-ahead nobody will use: its failure does not matter.
    }
  }
  ahead_.clear();
  ahead_bytes_ = 0;
  engine_.reset();
  file_.reset();
  remove_swap_directory(directory_, kSwapFileName);
}

at::Tensor NvmeParameterSwapper::new_buffer(const Slot& slot, size_t group) const {
  // Page aligned and a whole slot long: the direct path.
  return mapped_host_empty(slot.slot_bytes / static_cast<int64_t>(c10::elementSize(dtypes_[group])),
                           dtypes_[group]);
}

IoTicket NvmeParameterSwapper::submit(IoOp op, const Slot& slot, const at::Tensor& buffer) {
  return engine_->submit({{file_.get(), op, slot.file_offset, buffer.data_ptr(), slot.slot_bytes}});
}

void NvmeParameterSwapper::wait(IoTicket ticket) {
  const auto start = std::chrono::steady_clock::now();
  try {
    engine_->wait(ticket);
  } catch (...) {
    io_wait_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    throw;
  }
  io_wait_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void NvmeParameterSwapper::cancel_ahead(const BucketId& id) {
  auto it = ahead_.find(id);
  if (it == ahead_.end()) {
    return;
  }
  try {
    engine_->wait(it->second.ticket);  // the buffer must outlive its read
  } catch (const std::exception&) {
    // Its values were about to be replaced: the failure does not matter.
  }
  ahead_bytes_ -= slots_[id.first][id.second].slot_bytes;
  ahead_.erase(it);
}

// See [Note: parameter read-ahead]. Never throws: a read-ahead that cannot
// start (no memory for its buffer, a refused submission) only ends the
// read-ahead for this iteration, and the read it would have served then runs
// on demand and reports the failure, if it persists, where it is needed. A
// throw here would also unwind read() past a transfer still in flight.
void NvmeParameterSwapper::issue_ahead() noexcept {
  const auto limit = static_cast<size_t>(offload_.buffer_count());
  try {
    for (size_t next = cursor_; next < plan_.size() && ahead_.size() < limit; ++next) {
      const BucketId& id = plan_[next];
      const Slot& slot = slots_[id.first][id.second];
      if (!slot.on_nvme || ahead_.count(id) != 0) {
        continue;
      }
      Ahead ahead;
      ahead.buffer = new_buffer(slot, id.first);
      ahead.ticket = submit(IoOp::kRead, slot, ahead.buffer);
      ahead_.emplace(id, std::move(ahead));
      ahead_bytes_ += slot.slot_bytes;
      peak_ahead_bytes_ = std::max(peak_ahead_bytes_, ahead_bytes_);
    }
  } catch (const std::exception&) {
    following_ = false;
  }
}

at::Tensor NvmeParameterSwapper::read(size_t group, size_t bucket) {
  const BucketId id{group, bucket};
  if (trace_.size() < kMaxTrace) {
    trace_.push_back(id);
  }
  if (!plan_.empty()) {
    // Where this read is in the plan: next in line, or a little further on
    // (the plan skipped a read this iteration does not make).
    const size_t end = std::min(plan_.size(), cursor_ + kResyncWindow);
    const auto found = std::find(plan_.begin() + static_cast<std::ptrdiff_t>(cursor_),
                                 plan_.begin() + static_cast<std::ptrdiff_t>(end), id);
    following_ = found != plan_.begin() + static_cast<std::ptrdiff_t>(end);
    if (following_) {
      cursor_ = static_cast<size_t>(found - plan_.begin()) + 1;
    }
  }
  if (pending_ && pending_->group == group && pending_->bucket == bucket) {
    flush();  // the read must see every write
  }
  const Slot& slot = slots_[group][bucket];
  if (!slot.on_nvme) {
    if (following_) {
      issue_ahead();
    }
    return slot.host;
  }
  auto it = ahead_.find(id);
  if (it != ahead_.end()) {
    Ahead ahead = std::move(it->second);
    ahead_.erase(it);
    ahead_bytes_ -= slot.slot_bytes;
    if (following_) {
      issue_ahead();  // the next reads start before this one is waited for
    }
    wait(ahead.ticket);
    ++reads_ahead_;
    return ahead.buffer.narrow(0, 0, slot.numel);
  }
  at::Tensor buffer = new_buffer(slot, group);
  const IoTicket ticket = submit(IoOp::kRead, slot, buffer);
  if (following_) {
    issue_ahead();
  }
  wait(ticket);
  ++reads_on_demand_;
  return buffer.narrow(0, 0, slot.numel);
}

void NvmeParameterSwapper::write(size_t group, int64_t offset, const at::Tensor& values) {
  const at::Tensor source = values.to(at::kCPU, dtypes_.at(group)).contiguous().view({-1});
  const int64_t end = offset + source.numel();
  const std::vector<Slot>& slots = slots_[group];
  // Slots are in shard order: start at the last one beginning at or before
  // `offset` (the step writes a sub-group at a time, so a linear scan per
  // write would be quadratic in the buckets of a group).
  auto first =
      std::upper_bound(slots.begin(), slots.end(), offset,
                       [](int64_t at, const Slot& slot) { return at < slot.shard_offset; });
  for (size_t b = first == slots.begin() ? 0 : static_cast<size_t>(first - slots.begin()) - 1;
       b < slots.size() && slots[b].shard_offset < end; ++b) {
    const Slot& slot = slots[b];
    const int64_t begin = std::max(offset, slot.shard_offset);
    const int64_t stop = std::min(end, slot.shard_offset + slot.numel);
    if (begin < stop) {
      write_slot(group, b, begin - slot.shard_offset,
                 source.narrow(0, begin - offset, stop - begin));
    }
  }
}

// [Note: coalesced parameter writes]
// The step writes a group's shard sub-group by sub-group, in ascending order,
// and sub-groups cut buckets: writing each piece through its own
// read-patch-write of the slot would move every cut bucket's slot three or
// four times. Instead the bucket being written is assembled in one buffer
// (pending_) while its pieces arrive contiguously from its start, and goes to
// disk once, when complete or when a write to another bucket, a read of it,
// or flush() comes. A piece that leaves a gap (a run the step skipped, whose
// values must survive) first merges the slot's stored values in; so does a
// flush of an incomplete bucket.
void NvmeParameterSwapper::write_slot(size_t group, size_t bucket, int64_t begin,
                                      const at::Tensor& values) {
  Slot& slot = slots_[group][bucket];
  const int64_t n = values.numel();
  if (!slot.on_nvme) {
    slot.host.narrow(0, begin, n).copy_(values);
    return;
  }
  cancel_ahead({group, bucket});
  if (pending_ && (pending_->group != group || pending_->bucket != bucket)) {
    flush();
  }
  if (!pending_) {
    if (begin == 0 && n == slot.numel) {  // a whole slot: straight to disk
      at::Tensor buffer = new_buffer(slot, group);
      buffer.narrow(0, 0, n).copy_(values);
      wait(submit(IoOp::kWrite, slot, buffer));
      return;
    }
    pending_ = Pending{group, bucket, new_buffer(slot, group), 0, false};
  }
  Pending& pending = *pending_;
  if (!pending.merged && begin != pending.covered) {
    merge_stored_values();
  }
  pending.buffer.narrow(0, begin, n).copy_(values);
  if (!pending.merged) {
    pending.covered = begin + n;
    if (pending.covered == slot.numel) {
      flush();
    }
  }
}

void NvmeParameterSwapper::merge_stored_values() {
  Pending& pending = *pending_;
  const Slot& slot = slots_[pending.group][pending.bucket];
  at::Tensor stored = new_buffer(slot, pending.group);
  wait(submit(IoOp::kRead, slot, stored));
  stored.narrow(0, 0, pending.covered).copy_(pending.buffer.narrow(0, 0, pending.covered));
  pending.buffer = std::move(stored);
  pending.merged = true;
}

void NvmeParameterSwapper::flush() {
  if (!pending_) {
    return;
  }
  // Whatever happens, the bucket is no longer pending (a failed write is the
  // caller's error to report; the step then is incomplete).
  Pending pending = std::move(*pending_);
  pending_.reset();
  const Slot& slot = slots_[pending.group][pending.bucket];
  if (!pending.merged && pending.covered < slot.numel) {
    pending_ = std::move(pending);
    merge_stored_values();
    pending = std::move(*pending_);
    pending_.reset();
  }
  wait(submit(IoOp::kWrite, slot, pending.buffer));
}

void NvmeParameterSwapper::end_iteration() {
  flush();
  while (!ahead_.empty()) {
    cancel_ahead(ahead_.begin()->first);
  }
  plan_ = std::move(trace_);
  trace_.clear();
  cursor_ = 0;
  following_ = !plan_.empty();
  if (following_) {
    // Every shard is written now: the next iteration's first buckets can be
    // read while the program prepares its next batch.
    issue_ahead();
  }
}

}  // namespace zeroshard
