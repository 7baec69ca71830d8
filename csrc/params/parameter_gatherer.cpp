#include "zeroshard/parameter_gatherer.h"

#include "zeroshard/gradient_buckets.h"
#include "zeroshard/mapped_host_memory.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <set>

namespace zeroshard {

ParameterGatherer::ParameterGatherer(const PartitionLayout& layout, Communicator& comm,
                                     std::vector<at::TensorOptions> group_options,
                                     std::vector<std::string> unit_names,
                                     std::vector<std::vector<BucketId>> unit_buckets,
                                     ShardOf shard_of, int64_t prefetch_numel,
                                     int64_t max_live_numel)
    : layout_(layout),
      comm_(comm),
      group_options_(std::move(group_options)),
      unit_names_(std::move(unit_names)),
      unit_buckets_(std::move(unit_buckets)),
      shard_of_(std::move(shard_of)),
      prefetch_numel_(prefetch_numel),
      max_live_numel_(max_live_numel) {
  TORCH_INTERNAL_ASSERT(unit_names_.size() == unit_buckets_.size());
  for (const auto& buckets : unit_buckets_) {
    int64_t numel = 0;
    for (const auto& [g, b] : buckets) {
      numel += layout_.group(g).buckets()[b].numel;
    }
    unit_numel_.push_back(numel);
  }
  buckets_.resize(layout_.groups().size());
  for (size_t g = 0; g < buckets_.size(); ++g) {
    const auto& buckets = layout_.group(g).buckets();
    buckets_[g].resize(buckets.size());
    for (size_t b = 0; b < buckets.size(); ++b) {
      BucketState& bucket = buckets_[g][b];
      // On a CPU device a large bucket's storage is a mapping of its own, so
      // that releasing it returns the memory (see mapped_host_memory.h);
      // allocate() reuses the storage's allocator.
      bucket.full = empty_buffer(buckets[b].numel, group_options_[g]);
      bucket.persistent = buckets[b].unit == kNoUnit;
      bucket.residency = Residency::kResident;
      count_live(bucket, +1);
      // Free it before the next allocation, so that the buckets, filled one at
      // a time at construction, reuse one block instead of each touching its own.
      release(g, b);
    }
  }
  peak_live_bytes_ = live_bytes_;
}

void ParameterGatherer::ensure_allocated(size_t g, size_t b) {
  BucketState& bucket = state(g, b);
  if (bucket.residency == Residency::kReleased) {
    allocate(bucket);
  }
}

const char* ParameterGatherer::residency_name(Residency residency) {
  switch (residency) {
    case Residency::kReleased:
      return "released";
    case Residency::kGathering:
      return "gathering";
    case Residency::kResident:
      return "resident";
  }
  return "?";
}

void ParameterGatherer::settle(BucketState& bucket) {
  bucket.pending.wait();  // a no-op when none is in flight
  if (bucket.residency == Residency::kGathering) {
    bucket.residency = Residency::kResident;
  }
}

void ParameterGatherer::start_gather(size_t g, size_t b, at::Tensor input) {
  BucketState& bucket = state(g, b);
  TORCH_INTERNAL_ASSERT(bucket.residency == Residency::kResident, "all-gather into ", tag(g, b),
                        " while it is ", residency_name(bucket.residency),
                        "; a gather needs its storage allocated and no gather in flight");
  bucket.pending = comm_.all_gather(bucket.full, input, tag(g, b));
  bucket.residency = Residency::kGathering;
}

std::string ParameterGatherer::tag(size_t g, size_t b) const {
  const int64_t unit = layout_.group(g).buckets()[b].unit;
  return (unit == kNoUnit ? std::string("persistent") : unit_names_[unit]) + "/group" +
         std::to_string(g) + "/bucket" + std::to_string(b);
}

void ParameterGatherer::count_live(const BucketState& bucket, int64_t sign) {
  live_numel_ += sign * bucket.full.numel();
  live_bytes_ += sign * bucket.full.numel() * static_cast<int64_t>(bucket.full.element_size());
  peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
}

// See [Note: Released parameters]. The storage object stays (so every view
// stays valid); only its memory comes and goes. Going through the storage's
// own allocator keeps this device-agnostic (the CUDA caching allocator on GPU).
void ParameterGatherer::allocate(BucketState& bucket) {
  TORCH_INTERNAL_ASSERT(bucket.residency == Residency::kReleased,
                        "allocating a bucket's storage while it is ",
                        residency_name(bucket.residency), "; only a released bucket has none");
  c10::StorageImpl* storage = bucket.full.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(bucket.full.numel()) * bucket.full.element_size();
  TORCH_INTERNAL_ASSERT(storage->allocator() != nullptr, "bucket storage has no allocator");
  // The CUDA caching allocator allocates on the current device: a rank that
  // never called torch.cuda.set_device(local_rank) would get GPU 0's memory.
  const c10::OptionalDeviceGuard on_bucket_device(bucket.full.device());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
  bucket.residency = Residency::kResident;
  count_live(bucket, +1);
}

void ParameterGatherer::release(size_t g, size_t b) {
  BucketState& bucket = state(g, b);
  if (bucket.residency == Residency::kReleased || bucket.persistent) {
    return;
  }
  settle(bucket);  // never free what a collective still writes
  c10::StorageImpl* storage = bucket.full.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, bucket.full.device()));
  storage->set_nbytes(0);
  bucket.residency = Residency::kReleased;
  count_live(bucket, -1);
}

// A bucket the plan uses again within the prefetch window stays gathered
// (DeepSpeed's reuse distance): releasing it would only make the prefetch
// gather it again a moment later. E.g. the last blocks of the forward are the
// first of the backward, and a tied embedding is used at both ends.
bool ParameterGatherer::needed_soon(size_t g, size_t b) const {
  if (live_numel_ > max_live_numel_) {
    return false;
  }
  int64_t window = 0;
  for (size_t next = cursor_; next < previous_order_.size(); ++next) {
    const int64_t unit = previous_order_[next];
    window += unit_numel_[unit];
    if (window > prefetch_numel_) {
      return false;
    }
    for (const auto& id : unit_buckets_[unit]) {
      if (id.first == g && id.second == b) {
        return true;
      }
    }
  }
  return false;
}

void ParameterGatherer::maybe_release(size_t g, size_t b) {
  const BucketState& bucket = state(g, b);
  if (bucket.forward_refs == 0 && !bucket.backward_hold && !bucket.graph_hold && bucket.pins == 0 &&
      !needed_soon(g, b)) {
    release(g, b);
  }
}

void ParameterGatherer::gather(size_t g, size_t b, bool wait) {
  BucketState& bucket = state(g, b);
  if (bucket.residency == Residency::kReleased) {
    // The shard first: if it cannot be had (an NVMe read fails) the bucket
    // stays released instead of looking gathered with nothing behind it.
    at::Tensor input = shard_of_(g, b);
    allocate(bucket);
    start_gather(g, b, input);
  }
  if (wait) {
    settle(bucket);
  }
}

void ParameterGatherer::gather_unit(int64_t unit, bool wait) {
  for (const auto& [g, b] : unit_buckets_.at(unit)) {
    gather(g, b, wait);
  }
}

int64_t ParameterGatherer::unit_missing_numel(int64_t unit) const {
  int64_t numel = 0;
  for (const auto& [g, b] : unit_buckets_.at(unit)) {
    if (buckets_[g][b].residency == Residency::kReleased) {
      numel += buckets_[g][b].full.numel();
    }
  }
  return numel;
}

// Prefetch follows the order units were gathered on demand in the previous
// iteration, from where this iteration matches it. The plan is only a hint:
// a unit prefetched in vain is released later and a unit not prefetched is
// gathered on demand, so a module called twice, skipped, or run in a new
// order costs time, never correctness. Without an agreement every rank runs
// the same modules, so every rank derives the same prefetches (the order
// check verifies it); with one, a unit is prefetched only where every rank
// plans it.
std::vector<int64_t> ParameterGatherer::record_and_plan_prefetch(int64_t unit) {
  std::vector<int64_t> plan;
  current_order_.push_back(unit);
  // Loops without step() (evaluation) rotate the plan themselves.
  if (current_order_.size() > 16 * unit_names_.size() + 64) {
    previous_order_ = std::move(current_order_);
    current_order_.clear();
    cursor_ = 0;
  }
  auto match = std::find(previous_order_.begin() +
                             static_cast<std::ptrdiff_t>(std::min(cursor_, previous_order_.size())),
                         previous_order_.end(), unit);
  if (match == previous_order_.end()) {
    match = std::find(previous_order_.begin(), previous_order_.end(), unit);
  }
  if (match == previous_order_.end()) {
    return plan;
  }
  cursor_ = static_cast<size_t>(match - previous_order_.begin()) + 1;
  // The window is the units that follow, up to prefetch_numel elements of
  // them, gathered or not, so the look-ahead never grows beyond it. Buckets
  // an earlier unit of the plan brings count as gathered for the later ones,
  // and so do those of `unit` itself: negotiated, it is planned before it is
  // gathered (obtain_agreed), and max_live_parameters must count it.
  std::set<BucketId> planned;
  int64_t live = live_numel_;
  for (const auto& id : unit_buckets_[unit]) {
    if (buckets_[id.first][id.second].residency == Residency::kReleased &&
        planned.insert(id).second) {
      live += buckets_[id.first][id.second].full.numel();
    }
  }
  int64_t window = 0;
  for (size_t next = cursor_; next < previous_order_.size(); ++next) {
    const int64_t candidate = previous_order_[next];
    if (candidate == unit) {
      continue;
    }
    window += unit_numel_[candidate];
    int64_t missing = 0;
    for (const auto& id : unit_buckets_[candidate]) {
      if (buckets_[id.first][id.second].residency == Residency::kReleased &&
          planned.count(id) == 0) {
        missing += buckets_[id.first][id.second].full.numel();
      }
    }
    if (window > prefetch_numel_ || live + missing > max_live_numel_) {
      break;
    }
    if (missing > 0) {
      plan.push_back(candidate);
      live += missing;
      planned.insert(unit_buckets_[candidate].begin(), unit_buckets_[candidate].end());
    }
  }
  return plan;
}

void ParameterGatherer::record_and_prefetch(int64_t unit) {
  for (int64_t candidate : record_and_plan_prefetch(unit)) {
    gather_unit(candidate, /*wait=*/false);
  }
}

void ParameterGatherer::negotiate(std::unique_ptr<CollectiveAgreement> agreement,
                                  GradientBuckets* reductions) {
  agreement_ = std::move(agreement);
  reductions_ = reductions;
  offered_completions_ = reductions_ ? reductions_->completions() : 0;
}

void ParameterGatherer::wait_unit(int64_t unit) {
  for (const auto& [g, b] : unit_buckets_.at(unit)) {
    BucketState& bucket = state(g, b);
    TORCH_INTERNAL_ASSERT(bucket.residency != Residency::kReleased, "unit ", unit_names_.at(unit),
                          " was not gathered by the agreement");
    settle(bucket);
  }
}

// A bucket held here that another rank demands: this rank sends its slice
// again, in place (the values are the ones the buffer holds), and waits, so
// that nothing reads the buffer while the collective writes those same bytes.
void ParameterGatherer::gather_agreed(size_t g, size_t b) {
  BucketState& bucket = state(g, b);
  if (bucket.persistent) {
    return;  // persistent on every rank alike: never in a collective here
  }
  if (bucket.pins > 0) {
    // Pinned on every rank alike (pin is collective), so gathered everywhere;
    // a re-gather would overwrite a modifier rank's edits with the shards.
    return;
  }
  if (bucket.residency == Residency::kReleased) {
    gather(g, b, /*wait=*/false);
    return;
  }
  settle(bucket);
  const int64_t shard_numel = layout_.group(g).buckets()[b].shard_numel;
  start_gather(g, b, bucket.full.narrow(0, comm_.rank() * shard_numel, shard_numel));
  settle(bucket);
}

Agreement ParameterGatherer::run_agreement(AgreementRequest request) {
  if (reductions_) {
    request.ready = reductions_->ready_buckets();
    offered_completions_ = reductions_->completions();
  }
  std::set<int64_t> mine(request.demand.begin(), request.demand.end());
  mine.insert(request.prefetch.begin(), request.prefetch.end());
  Agreement agreed = agreement_->agree(std::move(request));
  Communicator::AgreedScope scope(comm_);
  for (int64_t unit : agreed.gather) {
    for (const auto& [g, b] : unit_buckets_.at(unit)) {
      gather_agreed(g, b);
    }
    if (mine.count(unit) == 0) {
      // Gathered only because another rank demanded it: released before the
      // next is gathered, so other ranks' demands hold one unit at a time
      // here. Every rank still issues one all-gather per agreed bucket, in
      // the same order.
      for (const auto& [g, b] : unit_buckets_.at(unit)) {
        settle(state(g, b));
        maybe_release(g, b);
      }
    }
  }
  if (reductions_) {
    reductions_->launch_agreed(agreed.reduce);
  }
  return agreed;
}

void ParameterGatherer::obtain_agreed(int64_t unit) {
  AgreementRequest request;
  if (unit_missing_numel(unit) > 0) {
    request.demand.push_back(unit);
  }
  request.prefetch = record_and_plan_prefetch(unit);
  const bool new_reductions = reductions_ && reductions_->completions() != offered_completions_;
  if (!request.demand.empty() || !request.prefetch.empty() || new_reductions) {
    run_agreement(std::move(request));
  }
  wait_unit(unit);
}

bool ParameterGatherer::wait_for_all_ranks(AgreementBarrier barrier) {
  if (!agreement_) {
    return false;
  }
  comm_.note("barrier", agreement_barrier_name(barrier));
  while (true) {
    AgreementRequest request;
    request.barrier = barrier;
    request.round_open = reductions_ != nullptr && reductions_->round_open();
    const Agreement agreed = run_agreement(std::move(request));
    if (!agreed.all_at_barrier) {
      continue;  // served another rank's gathers; it has not arrived yet
    }
    TORCH_CHECK_VALUE(!agreed.barriers_differ, "zeroshard stage 3: at step ", comm_.step(),
                      " rank ", comm_.rank(), " reached ", agreement_barrier_name(barrier),
                      " while another rank waits at a different point. Ranks may run different "
                      "modules within a forward or backward pass (they agree on each gather), but "
                      "every rank must run the same number of forward passes of the model and of "
                      "backward passes, and call step() together; e.g. give every rank the same "
                      "number of micro-batches, and run any extra forward (logging, evaluation) on "
                      "every rank. A reentrant activation checkpoint (use_reentrant=True) run on "
                      "some ranks only counts as a backward pass of its own there: use "
                      "use_reentrant=False");
    return agreed.round_open_on_some_ranks_only && !(reductions_ && reductions_->round_open());
  }
}

// Before a demanded gather would pass stage3_max_live_parameters, drop what
// is only kept for reuse or was prefetched: nobody references it now.
void ParameterGatherer::make_room(int64_t unit) {
  if (live_numel_ + unit_missing_numel(unit) <= max_live_numel_) {
    return;
  }
  const auto& mine = unit_buckets_.at(unit);
  for (size_t g = 0; g < buckets_.size(); ++g) {
    for (size_t b = 0; b < buckets_[g].size(); ++b) {
      const BucketState& bucket = buckets_[g][b];
      const bool in_use =
          bucket.forward_refs > 0 || bucket.backward_hold || bucket.graph_hold || bucket.pins > 0;
      if (!in_use && std::find(mine.begin(), mine.end(), BucketId{g, b}) == mine.end()) {
        release(g, b);
      }
    }
  }
}

void ParameterGatherer::pre_forward(int64_t unit, bool in_backward) {
  comm_.note(in_backward ? "recompute_pre_forward" : "pre_forward", unit_names_.at(unit));
  // The reference comes first, so that post_forward (which runs even when
  // this throws) always has one to drop.
  for (const auto& [g, b] : unit_buckets_.at(unit)) {
    if (in_backward) {
      state(g, b).backward_hold = true;
    } else {
      state(g, b).forward_refs += 1;
    }
  }
  make_room(unit);
  if (agreement_) {
    obtain_agreed(unit);
    return;
  }
  gather_unit(unit, /*wait=*/false);
  record_and_prefetch(unit);
  gather_unit(unit, /*wait=*/true);
}

void ParameterGatherer::post_forward(int64_t unit, bool in_backward) {
  comm_.note("post_forward", unit_names_.at(unit));
  if (in_backward) {
    return;  // held until its gradients arrive or backward ends
  }
  for (const auto& [g, b] : unit_buckets_.at(unit)) {
    BucketState& bucket = state(g, b);
    // Hooks registered while the unit's forward ran see only its end.
    if (bucket.forward_refs == 0) {
      continue;
    }
    bucket.forward_refs -= 1;
    maybe_release(g, b);
  }
}

void ParameterGatherer::pre_backward(int64_t unit, bool create_graph) {
  if (create_graph) {
    for (const auto& [g, b] : unit_buckets_.at(unit)) {
      state(g, b).graph_hold = true;
    }
  }
  // Every output of a unit's call fires this hook; only the first one of a
  // backward pass counts as a use.
  bool already_held = true;
  for (const auto& [g, b] : unit_buckets_.at(unit)) {
    already_held =
        already_held && state(g, b).backward_hold && state(g, b).residency != Residency::kReleased;
  }
  if (already_held) {
    return;
  }
  comm_.note("pre_backward", unit_names_.at(unit));
  for (const auto& [g, b] : unit_buckets_.at(unit)) {
    state(g, b).backward_hold = true;
  }
  make_room(unit);
  if (agreement_) {
    obtain_agreed(unit);
    return;
  }
  gather_unit(unit, /*wait=*/false);
  record_and_prefetch(unit);
  gather_unit(unit, /*wait=*/true);
}

void ParameterGatherer::bucket_complete(size_t g, size_t b) {
  BucketState& bucket = state(g, b);
  if (bucket.persistent) {
    return;
  }
  bucket.backward_hold = false;
  maybe_release(g, b);
}

void ParameterGatherer::backward_finished() {
  for (size_t g = 0; g < buckets_.size(); ++g) {
    for (size_t b = 0; b < buckets_[g].size(); ++b) {
      buckets_[g][b].backward_hold = false;
      maybe_release(g, b);  // also frees prefetched units nobody used
    }
  }
}

void ParameterGatherer::pin(const std::vector<BucketId>& buckets) {
  for (const auto& [g, b] : buckets) {
    if (agreement_) {
      // Every rank pins the same buckets, but a diverged forward may have
      // left some gathered on one rank only: every rank gathers each.
      gather_agreed(g, b);
    } else {
      gather(g, b, /*wait=*/false);
    }
    state(g, b).pins += 1;
  }
  for (const auto& [g, b] : buckets) {
    gather(g, b, /*wait=*/true);
  }
}

void ParameterGatherer::pin_for_initialization(const std::vector<BucketId>& buckets) {
  for (const auto& [g, b] : buckets) {
    BucketState& bucket = state(g, b);
    if (!bucket.initialized) {
      if (bucket.residency == Residency::kReleased) {
        allocate(bucket);
      }
      bucket.full.zero_();
      bucket.initialized = true;
    }
  }
  pin(buckets);
}

void ParameterGatherer::unpin(const std::vector<BucketId>& buckets) {
  for (const auto& [g, b] : buckets) {
    BucketState& bucket = state(g, b);
    TORCH_CHECK(bucket.pins > 0, "unpinning ", tag(g, b), " which is not pinned");
    bucket.pins -= 1;
    maybe_release(g, b);
  }
}

void ParameterGatherer::after_step() {
  for (size_t g = 0; g < buckets_.size(); ++g) {
    for (size_t b = 0; b < buckets_[g].size(); ++b) {
      BucketState& bucket = buckets_[g][b];
      bucket.backward_hold = false;
      bucket.graph_hold = false;
      settle(bucket);
      if (bucket.persistent || bucket.pins > 0 || bucket.forward_refs > 0) {
        // Still in use: refresh its values from the updated shards.
        start_gather(g, b, shard_of_(g, b));
      } else {
        release(g, b);
      }
    }
  }
  for (auto& group : buckets_) {
    for (auto& bucket : group) {
      settle(bucket);
    }
  }
  previous_order_ = std::move(current_order_);
  current_order_.clear();
  cursor_ = 0;
}

}  // namespace zeroshard
