// The gradient path of a ZeroOptimizer, from the autograd hooks (or .grad,
// at stage 1) to the averaged gradient shard the update reads: the hooks,
// the buckets and their reduce-scatters, stage 1's copies, no_sync, the
// reduction across hybrid-sharding replicas, the division by the world size
// and the loss scale, and the shards themselves. Internal to csrc/: the
// optimizer (csrc/optimizer/) owns one and drives it through the verbs below.
#pragma once

#include "stage1_gradient_copies.h"
#include "zeroshard/gradient_buckets.h"
#include "zeroshard/gradient_hooks.h"
#include "zeroshard/host_syncs.h"
#include "zeroshard/mapped_host_memory.h"
#include "zeroshard/nvme_gradient_swapper.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/process_groups.h"
#include "zeroshard/state_placement.h"
#include "zeroshard/zero_options.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace zeroshard {

class GradientReduction {
 public:
  // Stage 3's part in the gradient path, implemented by the parameter layer
  // above this one (which this layer does not include): a reduced bucket
  // lets its unit's gathered parameters go, and a backward pass ends on
  // every rank together.
  class Stage3Events {
   public:
    virtual ~Stage3Events() = default;
    // Bucket (group, bucket) was reduced.
    virtual void bucket_reduced(size_t group, size_t bucket) = 0;
    // Serves the other ranks until every rank's backward ended; true when
    // another rank delivered gradients this one did not (join their round).
    virtual bool wait_for_backward_end(bool outermost) = 0;
    // The outermost backward ended (or was abandoned): drop its holds.
    virtual void backward_finished() = 0;
  };

  // What the gradient path reads and does not own: the optimizer's.
  struct Parts {
    const ZeroOptions& options;
    // The facade's parameter groups: .grad, requires_grad, the hooks' keys.
    std::vector<torch::optim::OptimizerParamGroup>& param_groups;
    const PartitionLayout& layout;
    ProcessGroups& groups;
    const StatePlacement& placement;
    // Per group: the dtype and device of the buckets (reduce_in_fp32).
    std::vector<at::TensorOptions> grad_options;
    // offload_optimizer.swap_gradients: where the shards live instead.
    NvmeGradientSwapper* swapper = nullptr;
    // With offload the host kernel applies the averaging factor in its one
    // pass over the gradient: the shard keeps the sum (shard_scale()).
    bool defers_scale = false;
    // Stage 3 only.
    Stage3Events* stage3 = nullptr;
    HostSyncCounter& host_syncs;
  };

  // Allocates the gradient shards (stages 2-3; stage 1's live for a step)
  // and wires the buckets; installs no hooks (install_hooks()).
  explicit GradientReduction(Parts parts);
  // Removes the hooks and waits for the reductions in flight.
  ~GradientReduction();
  GradientReduction(const GradientReduction&) = delete;
  GradientReduction& operator=(const GradientReduction&) = delete;

  // [Note: what the gradient mutex guards]
  // Autograd runs hooks on its own threads (one per device, and the caller's
  // for CPU), the training thread runs step(), zero_grad() and the forward's
  // unit hooks. The mutex guards, between them: buckets_, hooks_, the shards,
  // stage1_copies_, phase_, grad_shard_scale_,
  // expected_gradients_, and what Stage3Events reaches: the stage-3
  // gatherer's bucket states (its pre-backward hooks run on autograd's
  // threads too, so the optimizer's stage 3 entry points take it as well). Recursive: a gradient
  // hook can complete a bucket whose release the gatherer handles, under the same lock, and
  // unsynced_gradients_. Not gradient_sync_, which is set outside backward.
  std::recursive_mutex& mutex() { return mutex_; }

  // ---- The hooks ----
  bool uses_hooks() const;
  // (Re)installs a hook on every parameter that requires a gradient.
  void install_hooks();
  // The buckets expect a gradient from every parameter that requires one
  // now ([Note: parameters unfrozen after construction]).
  void expect_current_gradients();
  void follow_requires_grad(bool outside_backward);
  // A forward or backward that runs in a backward pass: the hooks count it.
  void track_current_backward();
  // A gradient that reached (g, i)'s .grad without a hook (gradient_arrived).
  void gradient_arrived(size_t group, int64_t index);

  // ---- A step's reduction ----
  void set_sync(bool enabled) { gradient_sync_ = enabled; }
  bool sync() const { return gradient_sync_; }
  // Brings every rank's shard to the averaged gradient; idempotent until
  // clear(). `loss_scale` is undone with the averaging. Collective.
  void finish(double loss_scale);
  // Multiplies the averaged gradient by `coefficient` (a clip).
  void scale(const at::Tensor& coefficient);
  // The step consumed the gradients: empty shards, buckets ready for the
  // next backward.
  void clear();
  // zero_grad(): a backward that failed midway leaves a round open; forget it.
  void zero_grad();
  // Whether this rank reported a gradient for (g, i) since clear().
  bool reported(size_t group, int64_t index) const;
  // Group g's shard: the averaged gradient after finish() (times
  // shard_scale()); undefined where swapped to NVMe or at stage 1 between
  // steps.
  const at::Tensor& shard(size_t group) const { return shards_[group]; }
  double shard_scale() const { return grad_shard_scale_; }
  // Calls fn on [offset, offset + length) of group g's shard, at most
  // kShardChunkElements elements at a time (views), or
  // kGradientSwapBlockElements (fp32 copies read from the swap space).
  void for_each_chunk(size_t group, int64_t offset, int64_t length,
                      const std::function<void(const at::Tensor&)>& fn) const;
  // With the shards swapped to NVMe: every rank raises an I/O failure any
  // rank kept, naming `what` it stops. Collective there; nothing otherwise.
  void raise_swap_failure(const std::string& what);
  GradientBuckets& buckets() { return *buckets_; }

  // ---- Memory ----
  // Staging buckets, the shards on the device and every .grad.
  int64_t device_bytes() const;
  int64_t shard_bytes(bool on_host) const;
  int64_t host_bytes() const;
  int64_t cached_bytes() const;
  int64_t release_cached_buffers();

 private:
  void on_gradient(size_t group, int64_t index, const at::Tensor& param);
  void on_stage1_gradient(size_t group, int64_t index, const at::Tensor& grad);
  void end_backward(bool outermost);
  bool stage1_copies_current();
  void ensure_stage1_shards();
  at::Tensor new_stage1_shard(size_t group);
  at::Tensor take_leftover_grad(size_t group, int64_t index);
  void reduce_across_replicas();
  // A gradient was delivered: see [Note: the gradient phase].
  void gradient_delivered();
  at::TensorOptions shard_options(size_t group) const;
  NvmeGradientSwapper* swapped(size_t group) const;

  Parts parts_;
  std::recursive_mutex mutex_;
  std::vector<at::Tensor> shards_;  // per group: 1D, shard_numel, shard_options(g)
  std::unique_ptr<GradientBuckets> buckets_;
  std::unique_ptr<GradientHooks> hooks_;  // stages 2-3 (and 1 with overlap)
  // Stage 1's shard lives for a step; [Note: the stage-1 shard between steps].
  HostBufferPool stage1_shard_pool_;
  Stage1GradientCopies stage1_copies_;                 // stage 1 overlap: see its header
  std::vector<std::vector<bool>> expected_gradients_;  // requires_grad the buckets follow
  double grad_shard_scale_ = 1.0;                      // see Parts::defers_scale
  // [Note: the gradient phase]
  // kEmpty: nothing delivered since clear(). kAccumulating: backward passes
  // delivered gradients (to the buckets, the shards or .grad). kReduced:
  // finish() left the average in the shards; scale() and the update read
  // it. A gradient delivered in kReduced (a backward after clip_grad_norm,
  // gradient_norm or unscale_, before step()) would add a sum onto an
  // average, and at stage 1 with overlap be dropped: kMixed, which finish()
  // raises on every rank (they ran the same passes) until zero_grad().
  enum class Phase { kEmpty, kAccumulating, kReduced, kMixed };
  Phase phase_ = Phase::kEmpty;
  bool gradient_sync_ = true;
  bool unsynced_gradients_ = false;  // a backward ran under no_sync since the last reduction
};

}  // namespace zeroshard
