// Gradient buckets: the one mechanism that turns full per-parameter gradients
// into this rank's gradient shard, for every stage. Stage 1 feeds it from
// .grad at step time; stage 2 feeds it from autograd hooks during backward.
//
// A bucket is the range of the flat buffer the partition layout defines. Its
// gradients are copied into a staging buffer; when every parameter of the
// bucket has arrived, its reduce-scatter is launched asynchronously and the
// result is added into the gradient shard when waited on. Buckets launch in
// one fixed order (group by group, bucket by bucket), the same on every rank,
// whatever order the gradients arrive in: a bucket that is complete waits for
// the ones before it. A "round" launches every bucket once; missing gradients
// count as zero when a round is flushed.
//
// Thread-safety: callers serialise access (ZeroOptimizer holds a mutex).
#pragma once

#include "zeroshard/communicator.h"
#include "zeroshard/host_shard_receiver.h"
#include "zeroshard/mapped_host_memory.h"
#include "zeroshard/partition_layout.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

namespace zeroshard {

// The label of a bucket in the event log: "group<g>/bucket<b>".
std::string bucket_tag(size_t group, size_t bucket);

class GradientBuckets {
 public:
  // grad_options[g]: dtype and device of group g's gradients.
  // grad_shard_of(g): this rank's 1D gradient shard of group g, which reduced
  // bucket slices are added into; the owner may reallocate it between rounds.
  // It may live in host memory, in another dtype (CPU offload): slices then
  // travel there as they complete (HostShardReceiver).
  // max_in_flight bounds the buckets whose collectives are outstanding (and so
  // the staging memory).
  // With launch_eagerly false, buckets launch only at flush() (no overlap
  // with backward; DeepSpeed's overlap_comm=false).
  // on_complete(g, b), if set: every gradient of bucket b of group g arrived
  // in this round (stage 3 releases the bucket's parameters then).
  using GradShardOf = std::function<at::Tensor&(size_t group)>;
  using BucketComplete = std::function<void(size_t group, size_t bucket)>;
  GradientBuckets(const PartitionLayout& layout, Communicator& comm,
                  std::vector<at::TensorOptions> grad_options, GradShardOf grad_shard_of,
                  size_t max_in_flight, bool launch_eagerly = true,
                  BucketComplete on_complete = nullptr);

  // Parameters that never receive a gradient (requires_grad false): a bucket
  // does not wait for them (their slots are reduced as zeros). Call before the
  // first gradient; defaults to every parameter.
  void set_expects_gradient(std::vector<std::vector<bool>> expects_gradient);

  // Copies the full gradient of parameter `index` of group `group` into its
  // bucket and launches every bucket that is now complete and next in order.
  void add_gradient(size_t group, int64_t index, const at::Tensor& grad);

  // Fetches a gradient still held outside the buckets (e.g. accumulated in
  // .grad under no_sync), or an undefined tensor if there is none.
  using LeftoverGradient = std::function<at::Tensor(size_t group, int64_t index)>;

  // Ends the current round: launches every bucket not yet launched, taking
  // missing gradients from `leftover` or as zeros. If `force_round` and no
  // round ran since reset(), runs one so that this rank issues the same
  // collectives as ranks that had gradients.
  void flush(const LeftoverGradient& leftover, bool force_round);

  // Staging and output mappings freed and held for the next round.
  int64_t cached_bytes() const { return buffer_pool_.cached_bytes(); }
  int64_t release_cached_buffers() { return buffer_pool_.clear(); }

  // Waits for every launched bucket and adds its result into the shards
  // (host shards included).
  void wait_all();

  // Reduced slices of the groups `accept` takes go to it instead of their
  // shard: accept(g, shard offset, reduced slice) returns whether it took
  // the slice; `drain` runs when wait_all() has waited for every bucket (the
  // NVMe gradient swap: see nvme_gradient_swapper.h).
  using GradientSink = std::function<bool(size_t group, int64_t offset, const at::Tensor& reduced)>;
  void set_gradient_sink(GradientSink accept, std::function<void()> drain) {
    sink_ = std::move(accept);
    sink_drain_ = std::move(drain);
  }

  // [Note: the first round writes the shard]
  // The groups for which `writes[g]` is set have their first round after each
  // reset() reduce-scattered straight into the gradient shard: the shard's
  // contents before that round are never read, so its owner need not zero
  // it, and the round saves an output buffer and a pass adding it in. Later
  // rounds (a second synced backward before the step) add as before. Only
  // for groups whose shard has the buckets' device and dtype and takes no
  // sink; ZeroOptimizer decides, once, and asks first_round_writes_shard().
  void set_first_round_writes_shard(std::vector<bool> writes);
  bool first_round_writes_shard(size_t group) const {
    return group < first_round_writes_shard_.size() && first_round_writes_shard_[group];
  }

  // [Note: Negotiated collectives] (collective_agreement.h): with
  // `on_agreement`, complete buckets wait to be agreed on instead of
  // launching in order; ready_buckets() offers them, launch_agreed() launches
  // those complete on every rank (in launch order), and flush() the rest.
  // Buckets are numbered flat: group by group, bucket by bucket.
  void set_launch_on_agreement(bool on_agreement) { launch_on_agreement_ = on_agreement; }
  std::vector<int64_t> ready_buckets() const;
  void launch_agreed(const std::vector<int64_t>& flat_buckets);
  int64_t num_buckets() const { return static_cast<int64_t>(order_.size()); }
  // Buckets that completed so far (monotone): whether any is new to offer.
  int64_t completions() const { return completions_; }

  // [Note: pre-divided 16-bit gradients]
  // Gradients enter the staging buffers multiplied by 1 / `factor` (1: as
  // they are). Summing loss-scaled fp16 gradients over N ranks overflows
  // where their mean would not, so 16-bit reductions divide first, as DDP
  // does (gradient_predivide_factor); the owner divides the rest after.
  void set_predivide(double factor) { predivide_ = factor; }
  double predivide() const { return predivide_; }

  // Starts a new accumulation window: forgets which parameters reported.
  // Call only with nothing in flight and no round open.
  void reset();

  // After a backward pass failed midway (its end-of-backward never ran):
  // waits for what was launched, drops staged gradients and the open round.
  void abandon_round();

  // Makes the next flush(force_round) run a round even if one already ran
  // since reset() (gradients accumulated under no_sync after a synced pass).
  void require_round() { rounds_since_reset_ = 0; }

  // Whether the parameter delivered a gradient since the last reset().
  bool reported(size_t group, int64_t index) const { return reported_[group][index]; }
  // True while a round has started but not every bucket has launched.
  bool round_open() const { return round_started_; }
  // Rounds that ran since the last reset().
  int64_t rounds_since_reset() const { return rounds_since_reset_; }

  int64_t live_staging_bytes() const { return live_staging_bytes_; }
  int64_t peak_staging_bytes() const { return peak_staging_bytes_; }
  void reset_peak_staging_bytes() { peak_staging_bytes_ = live_staging_bytes_; }

 private:
  struct BucketState {
    at::Tensor staging;        // 1D, bucket.numel; defined once a gradient arrived
    std::vector<bool> filled;  // per slot of the bucket, this round
    int64_t pending = 0;       // non-empty parameters still missing this round
    bool launched = false;     // its reduce-scatter left this round
  };
  struct InFlight {
    PendingCollective work;
    at::Tensor staging;     // kept alive until the collective completed
    at::Tensor output;      // 1D, bucket.shard_numel
    bool in_shard = false;  // output is the shard's own slice: nothing to deliver
    size_t group = 0;
    size_t bucket = 0;
  };

  void start_round();
  // Ends a round in which every bucket launched; after the first eager one,
  // adopts the order buckets completed in (see [Note: launch order]).
  void finish_round();
  void adopt_completion_order();
  void ensure_staging(size_t group, size_t bucket);
  void launch(size_t group, size_t bucket);
  void launch_ready();
  void complete_oldest();
  void release_staging(const at::Tensor& staging);
  // target = grad / predivide_ (or += with accumulate).
  void stage(at::Tensor target, const at::Tensor& grad, bool accumulate) const;

  const PartitionLayout& layout_;
  Communicator& comm_;
  HostBufferPool buffer_pool_;       // staging and outputs (see [Note: recycled step buffers])
  HostShardReceiver host_receiver_;  // slices bound for host gradient shards
  std::vector<at::TensorOptions> grad_options_;
  GradShardOf grad_shard_of_;
  GradientSink sink_;
  std::function<void()> sink_drain_;
  BucketComplete on_complete_;
  size_t max_in_flight_;
  double predivide_ = 1.0;  // see set_predivide
  bool launch_eagerly_;
  bool launch_on_agreement_ = false;
  int64_t completions_ = 0;
  std::vector<int64_t> flat_base_;                 // [group]: flat number of its bucket 0
  std::vector<std::vector<BucketState>> buckets_;  // [group][bucket]
  std::vector<std::pair<size_t, size_t>> order_;   // launch order: (group, bucket)
  // Buckets in the order they completed during the first eager round.
  std::vector<std::pair<size_t, size_t>> completed_;
  bool order_adopted_ = false;
  size_t next_launch_ = 0;  // index into order_
  bool round_started_ = false;
  int64_t rounds_since_reset_ = 0;
  // A round finished since reset(): the shard holds a sum to add to.
  bool shard_holds_round_ = false;
  std::vector<bool> first_round_writes_shard_;  // [group]
  std::deque<InFlight> in_flight_;
  std::vector<std::vector<bool>> reported_;          // [group][param]
  std::vector<std::vector<bool>> expects_gradient_;  // [group][param]
  int64_t live_staging_bytes_ = 0;
  int64_t peak_staging_bytes_ = 0;
};

}  // namespace zeroshard
