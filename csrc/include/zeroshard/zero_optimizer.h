// zeroshard::ZeroOptimizer: a torch::optim::Optimizer that shards the
// optimizer state (ZeRO-1) and, at stage 2, the gradients across the ranks of
// a c10d process group.
//
//   auto pg = ...;  // c10::intrusive_ptr<c10d::ProcessGroup>
//   zeroshard::ZeroOptimizer optimizer(model->parameters(), pg,
//                                      torch::optim::AdamWOptions(1e-3),
//                                      zeroshard::ZeroOptions().stage(1));
//   loss.backward();
//   optimizer.step();
//
// One step, see docs/design.md: gradients are reduce-scattered bucket by
// bucket into this rank's gradient shard (at stage 1 from .grad inside
// step(); at stage 2 from autograd hooks during backward, releasing each
// .grad), divided by the world size, the inner optimizer updates the fp32
// master shard, and the updated shards are all-gathered straight into the
// model's parameters, which are views into one flat buffer per group.
//
// Thread-safety: like any torch::optim::Optimizer, drive it from one thread.
#pragma once

#include "zeroshard/communicator.h"
#include "zeroshard/gradient_buckets.h"
#include "zeroshard/gradient_hooks.h"
#include "zeroshard/inner_optimizer.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/zero_options.h"

#include <torch/csrc/api/include/torch/optim/optimizer.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

// The sharded optimizer state of one rank, as named tensors. Keys are stable
// and documented in docs/design.md ("Checkpoint format").
using ShardState = std::vector<std::pair<std::string, at::Tensor>>;

class ZeroOptimizer : public torch::optim::Optimizer {
 public:
  ZeroOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                const torch::optim::OptimizerOptions& inner_defaults, ZeroOptions options = {});
  ZeroOptimizer(std::vector<at::Tensor> params,
                c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                const torch::optim::OptimizerOptions& inner_defaults, ZeroOptions options = {});

  // Collective: every rank must call it. Reads each parameter's .grad, which
  // holds that rank's local gradient (gradients are averaged across ranks
  // here). Parameters with no gradient on any rank are left untouched, as
  // torch.optim does.
  at::Tensor step(LossClosure closure = nullptr) override;

  // Clears the gradients: each parameter's .grad (as torch::optim does) and,
  // at stage 2, the accumulated gradient shard. Hides the non-virtual base
  // method; step() also consumes the shard, so code holding a base reference
  // stays correct.
  void zero_grad(bool set_to_none = true);

  // Collective. Clips the gradients (the shard, after reduction) to a global
  // L2 norm of max_norm, as torch.nn.utils.clip_grad_norm_ does on the
  // unsharded model, and returns the total norm before clipping.
  at::Tensor clip_grad_norm(double max_norm);

  // While false (stage 2), backward passes leave gradients accumulating in
  // .grad with no communication, as DDP's no_sync(); the next backward with
  // sync on (or step()) reduces them.
  void set_gradient_sync(bool enabled) { gradient_sync_ = enabled; }
  bool gradient_sync() const { return gradient_sync_; }

  // Bytes of gradient storage held now: the gradient shard, staging buffers
  // alive, and any .grad still set on the parameters.
  int64_t gradient_bytes() const;
  // Largest staging-buffer footprint since construction or the last reset.
  int64_t peak_staging_bytes() const { return buckets_->peak_staging_bytes(); }
  void reset_peak_staging_bytes() { buckets_->reset_peak_staging_bytes(); }

  InnerOptimizerKind inner_kind() const { return inner_kind_; }
  const ZeroOptions& zero_options() const { return options_; }
  const PartitionLayout& layout() const { return *layout_; }
  Communicator& communicator() { return *comm_; }

  // The flat parameter buffer of group `group`; the model's parameters are
  // views into it.
  const at::Tensor& flat_parameters(size_t group) const;

  // Bytes of optimizer state held by this rank: fp32 master shard plus the
  // inner optimizer's state shards.
  int64_t optimizer_state_bytes() const;

  // This rank's shard of the optimizer state plus the layout it was made
  // with. Load it back with load_shard_state at the same world size.
  ShardState shard_state() const;
  // Collective: restores the state and writes the restored master weights
  // back into the model's parameters on every rank.
  void load_shard_state(const ShardState& state);

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  // Per group, this rank's shards and what it needs to use them.
  struct GroupShards {
    at::Tensor flat_param;  // 1D, layout.flat_numel(), parameter dtype
    at::Tensor grad_shard;  // 1D, shard_numel, parameter dtype
    // 1D, shard_numel, fp32. Undefined when the parameters are fp32: their
    // master values are this rank's slices of flat_param itself. See
    // [Note: fp32 master] in zero_optimizer.cpp.
    at::Tensor master;
    at::Tensor exp_avg;  // 1D, shard_numel, fp32 (Adam/AdamW)
    at::Tensor exp_avg_sq;
    at::Tensor max_exp_avg_sq;           // amsgrad only
    at::Tensor momentum_buffer;          // SGD with momentum only
    std::vector<int64_t> steps;          // per parameter: updates applied so far
    std::vector<ShardSegment> segments;  // what this rank owns
  };

  void initialize(c10::intrusive_ptr<c10d::ProcessGroup> process_group);
  void validate_parameters() const;
  void check_layout_agrees_across_ranks();
  void build_group_shards();
  void ensure_state_tensors(size_t group);
  // This rank's fp32 master values of one bucket (a view, updated in place).
  at::Tensor master_slice(size_t group, const Bucket& bucket);
  // The whole master shard as one contiguous tensor (a copy for fp32 params).
  at::Tensor master_shard(size_t group) const;
  void set_master_shard(size_t group, const at::Tensor& values);
  at::TensorOptions fp32_options() const;
  // One all-reduce: 1 where any rank had a gradient for the parameter.
  std::vector<std::vector<bool>> global_grad_presence();
  // Brings every rank's gradient shard to the averaged gradient (idempotent
  // until the next step): stage 1 reduces .grad now, stage 2 flushes what the
  // hooks left.
  void finish_gradient_reduction();
  void clear_gradient_shards();
  void on_gradient(size_t group, int64_t index, const at::Tensor& param);
  void on_backward_end();
  at::Tensor take_leftover_grad(size_t group, int64_t index);
  void update_shards(const std::vector<std::vector<bool>>& has_grad);
  void gather_parameters();

  InnerOptimizerKind inner_kind_;
  ZeroOptions options_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<PartitionLayout> layout_;
  std::vector<GroupShards> shards_;
  std::unique_ptr<GradientBuckets> buckets_;
  std::unique_ptr<GradientHooks> hooks_;  // stage 2 only
  std::mutex gradient_mutex_;             // hooks vs. the training thread
  bool gradients_reduced_ = false;        // shards hold the averaged gradient
  bool gradient_sync_ = true;
};

}  // namespace zeroshard
