// Stage 3: between uses each rank holds only its shard of every parameter.
// The ParameterGatherer owns the full-size buffers the model's parameters are
// views of, gathers them just before a unit needs them and frees their
// storage right after, and prefetches the units the previous iteration used
// next.
//
// A unit is a set of parameters gathered and released together (by default
// the parameters a module owns directly; see python/zeroshard/units.py). The
// partition layout gives each unit its own bucket, so gathering a unit is one
// all-gather per parameter group it spans.
//
// [Note: Released parameters]
// A released bucket keeps its tensor and every view of it (the model's
// parameters, and whatever autograd saved) with their sizes, but its storage
// holds no memory (nbytes 0, null data). Gathering allocates the storage again
// and all-gathers into it, so the same Parameter objects see the values.
// ATen alone does not make a read of a released parameter safe: kernels that
// check the storage fail ("... out of bounds for storage of size 0", "... its
// data is not allocated yet"), but others compute `nullptr + offset` and read
// it (SIGSEGV: clone, copy_, a DDP broadcast). From Python every stage-3
// parameter is a ShardedParameter that refuses such ops with an error naming
// it ([Note: a released parameter refuses reads] in sharded_parameter.py); a
// C++ program must not read a released parameter (pin_parameters gathers).
// A parameter used outside its unit's forward (e.g. `x @ self.embed.weight.T`
// in a parent module) must be in a unit whose forward encloses that use.
//
// When is a bucket held? While a forward of a unit that uses it runs
// (reference counted: units nest and modules are called twice), from a unit's
// pre-backward until its gradients have all arrived (or backward ends), while
// the user pins it (pin/unpin), and while the previous iteration's order says
// it is used again within the prefetch window (DeepSpeed's reuse distance;
// never beyond stage3_max_live_parameters). Persistent buckets (parameters of
// no unit, or below stage3_param_persistence_threshold) are never freed.
//
// With an agreement (negotiate()), the ranks agree on every gather and
// gradient reduction before issuing it, so they may run different modules,
// in any order, any number of times ([Note: Negotiated collectives] in
// collective_agreement.h); without one every rank must run the same modules
// in the same order.
//
// Thread-safety: called from the training thread and from autograd hooks on
// the backward thread, which never run at the same time; ZeroOptimizer
// serialises them with its mutex.
#pragma once

#include "zeroshard/collective_agreement.h"
#include "zeroshard/communicator.h"
#include "zeroshard/parameter_unit.h"
#include "zeroshard/partition_layout.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

class GradientBuckets;

// (group, bucket) of the partition layout.
using BucketId = std::pair<size_t, size_t>;

class ParameterGatherer {
 public:
  // shard_of(g, b): this rank's slice of bucket b of group g, in the
  // parameters' dtype: what the all-gather sends.
  using ShardOf = std::function<at::Tensor(size_t group, size_t bucket)>;

  ParameterGatherer(const PartitionLayout& layout, Communicator& comm,
                    std::vector<at::TensorOptions> group_options,
                    std::vector<std::string> unit_names,
                    std::vector<std::vector<BucketId>> unit_buckets, ShardOf shard_of,
                    int64_t prefetch_numel, int64_t max_live_numel);

  // The full-size 1D buffer of a bucket; parameters are views of it. Its
  // storage is empty while the bucket is released.
  at::Tensor& full(size_t group, size_t bucket) { return state(group, bucket).full; }
  bool materialized(size_t group, size_t bucket) const {
    return buckets_[group][bucket].residency != Residency::kReleased;
  }
  bool persistent(size_t group, size_t bucket) const { return buckets_[group][bucket].persistent; }

  int64_t num_units() const { return static_cast<int64_t>(unit_names_.size()); }
  const std::string& unit_name(int64_t unit) const { return unit_names_.at(unit); }
  const std::vector<BucketId>& unit_buckets(int64_t unit) const { return unit_buckets_.at(unit); }

  // Module hooks. pre_forward/pre_backward gather the unit (waiting for it)
  // and prefetch what came next last iteration; post_forward drops the
  // forward reference; bucket_complete drops the backward hold once every
  // gradient of a bucket has arrived; backward_finished drops every hold.
  // in_backward: the forward is a recomputation inside backward (activation
  // checkpointing). Its gather is held like a pre-backward one, because
  // non-reentrant checkpointing may stop the recomputation early, without
  // the post-forward hook.
  void pre_forward(int64_t unit, bool in_backward = false);
  void post_forward(int64_t unit, bool in_backward = false);
  // create_graph: a backward that builds a graph (torch.autograd.grad(...,
  // create_graph=True), a gradient penalty): the graph it builds uses the
  // unit's parameters in a later backward, which no hook of the unit
  // announces, so the unit stays gathered until after_step().
  void pre_backward(int64_t unit, bool create_graph = false);
  void bucket_complete(size_t group, size_t bucket);
  void backward_finished();

  // From here on every gather and every reduction of `reductions` (the
  // gradient buckets of the same layout; may be null) is agreed on first.
  void negotiate(std::unique_ptr<CollectiveAgreement> agreement, GradientBuckets* reductions);
  bool negotiated() const { return agreement_ != nullptr; }
  const CollectiveAgreement* agreement() const { return agreement_.get(); }
  // Collective when negotiated: returns once every rank is at a barrier,
  // having served what the others demanded meanwhile; ranks at different
  // kinds of barrier raise on every rank. Returns whether this rank must
  // join a gradient round other ranks have open and it has not (false when
  // not negotiated: a no-op then).
  bool wait_for_all_ranks(AgreementBarrier barrier);

  // Gathers (and waits for) the given buckets and holds them until unpin.
  void pin(const std::vector<BucketId>& buckets);
  void unpin(const std::vector<BucketId>& buckets);

  // After the optimizer updated the shards: buckets still materialized
  // (persistent, pinned) are gathered again; everything else is released. The
  // order observed in this iteration becomes the prefetch plan of the next.
  void after_step();

  // Partitioned construction (meta-device models): like pin(), but a bucket
  // whose values were never set gets zeroed storage instead of a gather. The
  // caller writes initial values, keeps this rank's slices, then unpins.
  void pin_for_initialization(const std::vector<BucketId>& buckets);
  // Buckets built from real parameters at construction need no initialization.
  void mark_initialized(size_t group, size_t bucket) { state(group, bucket).initialized = true; }

  // Elements of gathered parameter storage now (persistent buckets included).
  int64_t live_numel() const { return live_numel_; }
  // The same in bytes (groups may differ in dtype), and its peak.
  int64_t live_bytes() const { return live_bytes_; }
  int64_t peak_live_bytes() const { return peak_live_bytes_; }
  void reset_peak_live_bytes() { peak_live_bytes_ = live_bytes_; }

  // Allocates a released bucket's storage without filling it.
  void ensure_allocated(size_t group, size_t bucket);
  // Frees a resident bucket now (no reference may hold it).
  void release(size_t group, size_t bucket);
  // Allocates and all-gathers one bucket; waits when `wait`.
  void gather(size_t group, size_t bucket, bool wait);

 private:
  // [Note: a bucket's residency]
  // kReleased: its storage holds no memory (every view stays valid and reads
  // nothing). kGathering: storage allocated, an all-gather in flight writes
  // it (`pending`); nothing may read or free it before settle(). kResident:
  // it holds values (gathered, or written at construction or
  // initialization). allocate() takes kReleased to kResident, gather()
  // kReleased (or, re-sent, kResident) to kGathering, settle() kGathering to
  // kResident, release() any state to kReleased, settling first. Each
  // transition checks where it starts.
  enum class Residency { kReleased, kGathering, kResident };
  static const char* residency_name(Residency residency);

  struct BucketState {
    at::Tensor full;  // 1D, bucket.numel
    bool persistent = false;
    Residency residency = Residency::kReleased;
    PendingCollective pending;  // the all-gather while kGathering
    int64_t forward_refs = 0;
    bool backward_hold = false;
    bool graph_hold = false;  // see pre_backward's create_graph
    int64_t pins = 0;
    bool initialized = false;  // holds real values (see pin_for_initialization)
  };

  BucketState& state(size_t group, size_t bucket) { return buckets_.at(group).at(bucket); }
  void maybe_release(size_t group, size_t bucket);
  bool needed_soon(size_t group, size_t bucket) const;
  void make_room(int64_t unit);
  void gather_unit(int64_t unit, bool wait);
  void wait_unit(int64_t unit);
  // Records `unit` in this iteration's order and returns the units to
  // prefetch after it, following the previous iteration's order.
  std::vector<int64_t> record_and_plan_prefetch(int64_t unit);
  void record_and_prefetch(int64_t unit);
  // Negotiated: agrees on `unit` (demanded if missing), its prefetches and
  // the ready reductions, then issues what was agreed.
  void obtain_agreed(int64_t unit);
  Agreement run_agreement(AgreementRequest request);
  void gather_agreed(size_t group, size_t bucket);
  int64_t unit_missing_numel(int64_t unit) const;
  void allocate(BucketState& bucket);
  // Issues the all-gather of this rank's `input` into the bucket's storage.
  void start_gather(size_t group, size_t bucket, at::Tensor input);
  // Waits for the bucket's all-gather, if one is in flight.
  static void settle(BucketState& bucket);
  void count_live(const BucketState& bucket, int64_t sign);
  std::string tag(size_t group, size_t bucket) const;

  const PartitionLayout& layout_;
  Communicator& comm_;
  std::vector<at::TensorOptions> group_options_;
  std::vector<std::string> unit_names_;
  std::vector<std::vector<BucketId>> unit_buckets_;
  std::vector<int64_t> unit_numel_;  // elements of each unit's buckets
  std::vector<std::vector<BucketState>> buckets_;
  ShardOf shard_of_;
  int64_t prefetch_numel_;
  int64_t max_live_numel_;
  int64_t live_numel_ = 0;
  int64_t live_bytes_ = 0;
  int64_t peak_live_bytes_ = 0;
  // Prefetch plan: the units gathered on demand during the last iteration,
  // in order, and how far this iteration has followed it.
  std::vector<int64_t> previous_order_;
  std::vector<int64_t> current_order_;
  size_t cursor_ = 0;
  std::unique_ptr<CollectiveAgreement> agreement_;  // see negotiate()
  GradientBuckets* reductions_ = nullptr;
  int64_t offered_completions_ = 0;  // reductions_->completions() at the last agreement
};

}  // namespace zeroshard
