// zeroshard::ZeroOptimizer: a torch::optim::Optimizer that shards the
// optimizer state (ZeRO-1) and, at stage 2, the gradients across the ranks of
// a c10d process group; at stage 3 the parameters too.
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

#include "zeroshard/checkpoint.h"
#include "zeroshard/communicator.h"
#include "zeroshard/gradient_buckets.h"
#include "zeroshard/gradient_hooks.h"
#include "zeroshard/inner_optimizer.h"
#include "zeroshard/mapped_host_memory.h"
#include "zeroshard/nvme_parameter_swapper.h"
#include "zeroshard/offloaded_optimizer_state.h"
#include "zeroshard/parameter_gatherer.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/state_placement.h"
#include "zeroshard/tensor_parallel_split.h"
#include "zeroshard/zero_options.h"

#include <torch/csrc/api/include/torch/optim/optimizer.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
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
                const torch::optim::OptimizerOptions& inner_defaults, ZeroOptions options = {},
                std::vector<ParameterUnit> units = {});
  // Stage 3: `units` say which parameters are gathered together (see
  // unit_module.h for torch::nn models, python/zeroshard/units.py for Python
  // ones). Parameters in no unit, or smaller than
  // stage3_param_persistence_threshold, stay gathered. Parameters on the meta
  // device are not materialized here: see replacement_parameters().
  ZeroOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                const torch::optim::OptimizerOptions& inner_defaults, ZeroOptions options,
                std::vector<ParameterUnit> units);
  // Hybrid sharding (FSDP2's HSDP, DeepSpeed's zero_hpz_partition_size): the
  // state is sharded over `process_group` (e.g. the ranks of one node) and
  // replicated over `replicate_group` (the ranks holding the same shard in
  // the other shard groups). Gradients are reduce-scattered within the shard
  // group and their shards all-reduced across replicas; parameters are
  // all-gathered within the shard group only. A null or one-rank
  // replicate_group is plain sharding. Every collective of this optimizer is
  // issued on one of the two groups, so every rank of both must call it.
  ZeroOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                c10::intrusive_ptr<c10d::ProcessGroup> replicate_group,
                const torch::optim::OptimizerOptions& inner_defaults, ZeroOptions options,
                std::vector<ParameterUnit> units = {});
  ~ZeroOptimizer() override;

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
  // Collective: the global L2 norm of the averaged gradients (what
  // clip_grad_norm clips), and the multiplication of every gradient by
  // `coefficient` (a scalar tensor): clip_grad_norm is the two, and several
  // optimizers of one model (dense and expert parameters) clip by their
  // combined norm with them.
  at::Tensor gradient_norm();
  void scale_gradients(const at::Tensor& coefficient);

  // The factor the loss was multiplied by (fp16 loss scaling): step() and
  // clip_grad_norm divide the reduced gradients by it. 1 by default.
  void set_loss_scale(double scale);
  double loss_scale() const { return loss_scale_; }
  // Whether the last step() found non-finite gradients (skip_nonfinite_steps)
  // and left every parameter and state unchanged; and how many did so far.
  bool last_step_skipped() const { return last_step_skipped_; }
  // The next step() skips as for non-finite gradients, whatever it finds:
  // for a decision taken over several optimizers (zeroshard.clip_grad_norm_
  // found their joint norm non-finite), so all skip together. Every rank
  // must call it alike.
  void skip_next_step() { skip_requested_ = true; }
  int64_t skipped_steps() const { return skipped_steps_; }

  // While false (stage 2), backward passes leave gradients accumulating in
  // .grad with no communication, as DDP's no_sync(); the next backward with
  // sync on (or step()) reduces them.
  void set_gradient_sync(bool enabled) { gradient_sync_ = enabled; }
  bool gradient_sync() const { return gradient_sync_; }

  // Bytes of gradient storage held now on the training device: the gradient
  // shard, staging buffers alive, and any .grad still set on the parameters.
  // A gradient shard in host memory (offload) counts in
  // host_gradient_bytes() and host_model_state_bytes() instead.
  int64_t gradient_bytes() const;
  int64_t host_gradient_bytes() const;
  // Largest staging-buffer footprint since construction or the last reset.
  int64_t peak_staging_bytes() const { return buckets_->peak_staging_bytes(); }
  void reset_peak_staging_bytes() { buckets_->reset_peak_staging_bytes(); }
  // Host buffers kept from one step to the next (gradient staging,
  // reduce-scatter outputs and receive rows; see mapped_host_memory.h), at
  // most one step's peak.
  int64_t cached_buffer_bytes() const;
  // Unmaps them, as torch.cuda.empty_cache does for CUDA's cache (e.g. before
  // an evaluation that needs the memory); the next step maps afresh. Returns
  // the bytes given back. Local: no collective.
  int64_t release_cached_buffers();

  InnerOptimizerKind inner_kind() const { return inner_kind_; }
  const ZeroOptions& zero_options() const { return options_; }
  const PartitionLayout& layout() const { return *layout_; }
  // The shard group's communicator, and the replicate group's (null without
  // hybrid sharding).
  Communicator& communicator() { return *comm_; }
  Communicator* replica_communicator() { return replica_comm_.get(); }
  // Ranks whose gradients are averaged: shard group size x replicas.
  int64_t data_parallel_world_size() const;

  // Tensor parallelism (zero_optimizer_tensor_parallel.cpp): this
  // optimizer's parameters are this rank's pieces of tensors split over
  // `group` where sharded[g][i] is true, and copies equal on every rank of
  // `group` elsewhere (PyTorch TP's Shard and Replicate placements). The
  // global gradient norm then counts every piece once and every copy once,
  // as clip_grad_norm_ on the unsplit model, and a non-finite gradient on
  // any rank of `group` skips the step on all of them. Collective over
  // `group` from then on: call it on every rank, before the first step.
  // `splits` (one per parameter, as `sharded`) says where each piece sits in
  // its unsplit tensor; checkpoints need it (they store unsplit tensors, so
  // they load at any tensor-parallel degree or without TP).
  void set_tensor_parallel(c10::intrusive_ptr<c10d::ProcessGroup> group,
                           std::vector<std::vector<bool>> sharded,
                           std::vector<std::vector<TensorParallelSplit>> splits = {});
  // This rank's number in checkpoints: among the ranks that write one (the
  // first replica's shard group times the tensor-parallel group) it names
  // the data file; the other replicas' ranks follow. Names RNG files.
  int64_t checkpoint_rank() const;
  // A gradient the caller moved into parameter (group, index)'s .grad from
  // where autograd put it, handled as the parameter's own hook would: for a
  // parameter that is not autograd's leaf itself (the Python layer passes a
  // DTensor's local tensor, whose gradient autograd puts on the DTensor).
  // Call it from inside the backward pass.
  void gradient_arrived(size_t group, int64_t index);

  // The flat parameter buffer of group `group`; the model's parameters are
  // views into it.
  const at::Tensor& flat_parameters(size_t group) const;

  // Bytes of optimizer state held by this rank: fp32 master shard plus the
  // inner optimizer's state shards (with offload, on both tiers, including
  // the host staging buffers).
  int64_t optimizer_state_bytes() const;
  // Model-state bytes (parameters, gradients, optimizer state) this rank
  // holds on the training device and in host memory: with offload the two
  // differ even on a CPU-only machine, where both are the same RAM.
  int64_t device_model_state_bytes() const;
  int64_t host_model_state_bytes() const;
  // Where each sub-group's state lives (see state_placement.h).
  const StatePlacement& placement() const { return *placement_; }
  // With offload_optimizer on NVMe: the swap space's telemetry; else null.
  const NvmeStateSwapper* nvme_swapper() const { return offloaded_ ? offloaded_->nvme() : nullptr; }
  // With offload_optimizer.swap_gradients: the gradient swap space; else null.
  const NvmeGradientSwapper* gradient_swapper() const {
    return offloaded_ ? offloaded_->gradient_swapper() : nullptr;
  }
  // With offload_param on NVMe (stage 3): the parameter swap space; else null.
  const NvmeParameterSwapper* parameter_swapper() const { return param_swapper_.get(); }

  // This rank's shard of the optimizer state plus the layout it was made
  // with. Load it back with load_shard_state at the same world size.
  ShardState shard_state() const;
  // Collective: restores the state and writes the restored master weights
  // back into the model's parameters on every rank.
  void load_shard_state(const ShardState& state);

  // ---- Checkpoints that load at any world size and stage (checkpoint.h) ----
  // Names the parameters in checkpoints: (name, parameter) pairs such as a
  // module's named_parameters(). A parameter listed under several names (tied
  // weights) is stored under the first and found under any. Unnamed ones are
  // "group<g>.<i>". Every rank must give the same names.
  void set_parameter_names(const std::vector<std::pair<std::string, at::Tensor>>& named);
  std::string parameter_name(size_t group, size_t index) const;
  std::vector<std::string> parameter_aliases(size_t group, size_t index) const;
  // Collective: writes this optimizer's state (fp32 master, moments, step
  // counts, hyper-parameters) as the checkpoint directory `path`, atomically.
  // Errors (disk full, permissions) are raised on every rank, naming the rank.
  void save_checkpoint(const std::string& path, const CheckpointSaveOptions& options = {});
  // Collective: loads a checkpoint saved at any world size, stage, bucket size,
  // grouping or offload setting; parameters are matched by name. Each rank
  // reads only the ranges it owns, checksums verified. Any error (another
  // model, a corrupt or missing file) is raised on every rank before anything
  // changes. Writes the loaded weights into the model's parameters.
  LoadedCheckpoint load_checkpoint(const std::string& path,
                                   const CheckpointLoadOptions& options = {});
  // Waits for an asynchronous save (CheckpointSaveOptions::async_save) and
  // throws, on every rank alike, if it failed. Not collective.
  void wait_for_checkpoint();
  bool checkpoint_in_flight() const;
  // Where an asynchronous save's ranks agree on its commit when they span
  // more than the shard group (tensor parallelism, hybrid sharding): a store
  // every one of them reaches, e.g. the default group's, and a prefix equal
  // on every rank (the Python layer passes the world's store). Without it,
  // the shard group's failure store serves a plain data-parallel save.
  void set_checkpoint_store(c10::intrusive_ptr<c10d::Store> store, std::string prefix);

  // The per-rank format of shard_state(), for the same world size only.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Collective. The full fp32 values (the master weights) of every parameter,
  // per group, on rank `rank`; other ranks get empty lists. Works at every
  // stage; gathers one bucket at a time.
  std::vector<std::vector<at::Tensor>> full_parameters(int64_t rank = 0);

  // ---- Stage 3 ---------------------------------------------------------------
  // Unit hooks, called by the module hooks (Python) or UnitModule (C++).
  // With check_collective_order (the default) ranks may call them for
  // different units, in any order, any number of times: they agree on each
  // gather ([Note: Negotiated collectives] in collective_agreement.h).
  // Without it every rank must call them in the same order.
  int64_t num_units() const;
  int64_t unit_index(const std::string& name) const;
  void unit_pre_forward(int64_t unit);
  void unit_post_forward(int64_t unit);
  // Makes the unit's backward gather its parameters first: hooks `output`
  // (when it requires grad) so that its gradient triggers the gather.
  void unit_track_output(int64_t unit, const at::Tensor& output);
  // Around the model's whole forward (Python: hooks on module=; C++:
  // ModelForward in unit_module.h). Collective: when the outermost forward
  // returns, each rank waits until every rank's forward returned, serving the
  // others' gathers meanwhile, so that code between forward and backward
  // (a metric's all-reduce) never meets a rank still gathering. `raised`:
  // the forward threw; there is no wait then. Inside backward (activation
  // recomputation) both are no-ops.
  void model_forward_begin();
  void model_forward_end(bool raised = false);
  // Agreements made so far and how many found the ranks asking differently
  // (0 for both without negotiation).
  int64_t agreements() const;
  int64_t diverged_agreements() const;

  // Collective. Gathers the buckets holding `params` (all parameters when
  // empty) and keeps them gathered until unpin_parameters. With
  // modifier_rank >= 0, unpinning broadcasts that rank's values and stores
  // them in the shards (edits made while gathered persist); with hybrid
  // sharding, modifier_rank is a rank of the first replica's shard group and
  // every replica gets its values. Any stage: at stages 1 and 2 parameters
  // are always gathered, so only the broadcast acts.
  void pin_parameters(const std::vector<at::Tensor>& params);
  void unpin_parameters(const std::vector<at::Tensor>& params, int64_t modifier_rank = -1);

  // Partitioned construction: when the parameters were on the meta device,
  // the tensors to use instead (same shapes, on materialize_device, views of
  // the released bucket buffers), per group; undefined where the parameter
  // was not meta. Put them in the model, then call adopt_parameters.
  const std::vector<std::vector<at::Tensor>>& replacement_parameters() const {
    return replacements_;
  }
  // Replaces the optimizer's parameters by `params` (per group, same shapes),
  // which must be the replacements (or tensors sharing their storage).
  void adopt_parameters(const std::vector<std::vector<at::Tensor>>& params);
  // Collective. Gathers (or zero-allocates, the first time) the storage of
  // `params` so initial values can be written into them in place;
  // end_initialization keeps this rank's slices and releases the storage.
  void begin_initialization(const std::vector<at::Tensor>& params);
  void end_initialization(const std::vector<at::Tensor>& params);
  // Collective, once after the last end_initialization: `local_error` is
  // this rank's initializer failure ("" for none). Any rank's is raised on
  // every rank (naming the rank), so no rank goes on to train, or to wait in
  // its first collective, beside one that stopped. A rank whose initializer
  // failed keeps calling begin/end_initialization for the remaining modules
  // so the collectives stay matched.
  void finish_initialization(const std::string& local_error);

  // Bytes of parameter storage held now: the parameter shards (stage 3), the
  // gathered buffers (every stage), and the peak of the latter since reset.
  int64_t parameter_bytes() const;
  int64_t gathered_parameter_bytes() const;
  int64_t peak_gathered_parameter_bytes() const;
  void reset_peak_gathered_parameter_bytes();

 private:
  // Per group, this rank's shards and what it needs to use them.
  struct GroupShards {
    at::TensorOptions param_options;  // dtype and device of the parameters
    at::TensorOptions grad_options;   // of buckets and the gradient shard (reduce_in_fp32)
    at::Tensor flat_param;            // stages 1-2: 1D, layout.flat_numel(), parameter dtype
    // Stage 3: this rank's parameter values, 1D, shard_numel, parameter dtype;
    // what the all-gathers send. For fp32 parameters it is also the master.
    at::Tensor param_shard;
    // 1D, shard_numel, grad_shard_options(g): grad_options, or in host
    // memory (fp32 with 'cpu' offload) when the placement says so.
    // Undefined where the gradient shard is swapped to NVMe
    // (swapped_gradients(g)).
    at::Tensor grad_shard;
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

  void initialize(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                  c10::intrusive_ptr<c10d::ProcessGroup> replicate_group,
                  std::vector<ParameterUnit> units);
  // ---- Hybrid sharding (zero_optimizer_replicas.cpp); no-ops without it ----
  // An error found on some ranks of either group raised on every rank.
  void raise_if_any_rank_failed(const std::string& local_error, const std::string& what);
  // Every rank's error ("" for none) combined over the shard group, then
  // across replicas, then across the tensor-/expert-parallel group: the same
  // string on every rank.
  std::string agreed_error(const std::string& local_error, const std::string& tag);
  // The shard, replica and tensor-parallel communicators this optimizer has.
  std::vector<Communicator*> communicators() const;
  // A group added after construction (C++ add_param_group is not virtual)
  // has no place in the partition layout: an error, before any collective.
  void check_groups_fixed() const;
  // Replica 0's values on every replica (after the shard group's broadcast).
  void broadcast_across_replicas(at::Tensor& tensor, const std::string& tag);
  void max_across_replicas(at::Tensor& tensor, const std::string& tag);
  // Sums the reduced gradient shards over the replicas.
  void reduce_gradient_shards_across_replicas();
  // ---- Tensor parallelism; no-ops without it ----
  // squares: [sum over TP-sharded pieces, sum over the rest] of the reduced
  // gradients' squares on this rank, summed over the data-parallel group;
  // returns the global sum of squares.
  at::Tensor sum_squares_across_tensor_parallel(at::Tensor squares);
  void max_across_tensor_parallel(at::Tensor& tensor, const std::string& tag);
  // The shard group's save: what save_checkpoint runs on the first replica.
  void save_checkpoint_shards(const std::string& path, const CheckpointSaveOptions& options);
  std::vector<std::vector<int64_t>> assign_units(const std::vector<ParameterUnit>& units,
                                                 std::vector<std::string>& unit_names,
                                                 std::vector<std::vector<at::Tensor>>& unit_params);
  void build_stage3_shards(size_t group);
  void install_gradient_hooks();
  void set_bucket_expectations();
  // Fills param_index_ from param_groups_ (after validation and adoption).
  void index_parameters();
  std::vector<BucketId> buckets_of(const std::vector<at::Tensor>& params) const;
  c10::Device device() const { return device_; }
  void validate_parameters() const;
  void check_layout_agrees_across_ranks();
  void build_group_shards();
  void ensure_state_tensors(size_t group);
  // This rank's fp32 master values of one bucket (a view, updated in place).
  at::Tensor master_slice(size_t group, const Bucket& bucket);
  // The whole master shard as one contiguous tensor (a copy for fp32 params).
  at::Tensor master_shard(size_t group) const;
  void set_master_shard(size_t group, const at::Tensor& values);
  // Master values of [offset, offset + length) of a group's shard, as an fp32
  // copy on the device; and the write into them. Every stage and placement.
  at::Tensor read_master(size_t group, int64_t offset, int64_t length) const;
  void write_master(size_t group, int64_t offset, const at::Tensor& values);
  // Optimizer state or parameter shards live in NVMe swap space.
  bool swaps_to_nvme() const {
    return (placement_->offload_tier() == StateTier::kNVMe && offloaded_) ||
           param_swapper_ != nullptr;
  }
  // With NVMe: every rank raises a write error any rank kept (with what was
  // being written); see [Note: writes outside the step]. Collective there.
  void raise_agreed_write_error(std::string error, const std::string& what);
  // Offload: writes updated parameter values (the parameters' dtype) into the
  // copy the device uses: this rank's slices of flat_param (stages 1-2) or
  // param_shard (stage 3).
  void write_parameter_values(size_t group, int64_t offset, const at::Tensor& values, bool async);
  // Offload: the parameters the device uses from the master values (after a
  // load), before they are gathered.
  void refresh_parameters_from_master();
  at::TensorOptions fp32_options() const;
  // Checkpoints: whether group `g` holds `name` now, and a range of it (fp32).
  bool has_state(size_t g, OptimizerStateName name) const;
  nlohmann::json checkpoint_index_skeleton(const CheckpointSaveOptions& options) const;
  // Checkpoints under tensor parallelism (zero_optimizer_tensor_parallel.cpp):
  // where parameter (g, i) sits in its unsplit tensor; whether this rank
  // writes it (a copy is written by tensor-parallel rank 0 only); how many
  // ranks write; every writer's string in checkpoint_rank() order; an error
  // agreed over the shard and tensor-parallel groups, raised on every rank.
  TensorParallelSplit tensor_parallel_split(size_t g, size_t i) const;
  bool writes_checkpoint_piece(size_t g, size_t i) const;
  int64_t checkpoint_writer_count() const;
  std::vector<std::string> all_gather_checkpoint_strings(const std::string& mine,
                                                         const std::string& tag);
  void agree_on_checkpoint_errors(const std::string& local_error, const std::string& what);
  void finish_checkpoint_quietly() noexcept;  // destructor: wait, report to stderr
  // Joins an asynchronous save in flight; its error ("" if none).
  std::string finish_pending_checkpoint();
  // The store and key on which the ranks of the next asynchronous save of
  // `path` agree (the same on every rank: each counts its saves); throws
  // where no store reaches them all.
  std::pair<c10::intrusive_ptr<c10d::Store>, std::string> next_checkpoint_commit(
      const std::string& path);
  at::Tensor read_state(size_t g, OptimizerStateName name, int64_t offset, int64_t length) const;
  // One all-reduce: 1 where any rank had a gradient for the parameter; with
  // skip_nonfinite_steps, *overflow says whether any rank's gradients hold
  // inf/NaN; *any_detached whether any rank passed detached = true (the same
  // collective).
  std::vector<std::vector<bool>> global_grad_presence(bool* overflow, bool detached,
                                                      bool* any_detached);
  // [Note: parameters that left the optimizer's storage]
  // (zero_optimizer_attachment.cpp): re-attaches parameters copied with their
  // values unchanged (model.to("cpu:0")); returns what could not be (moved to
  // another device or dtype, other values), "" when every parameter is
  // attached. Local: the step agrees on it.
  std::string reattach_parameters();
  // The buffer whose storage parameter (g, i) must view, and the storage
  // offset it must start at.
  std::pair<const at::Tensor*, int64_t> attached_place(size_t g, size_t i) const;
  // Brings every rank's gradient shard to the averaged gradient (idempotent
  // until the next step): stage 1 reduces .grad now, stage 2 flushes what the
  // hooks left.
  void finish_gradient_reduction();
  void clear_gradient_shards();
  void on_gradient(size_t group, int64_t index, const at::Tensor& param);
  void on_stage1_gradient(size_t group, int64_t index, const at::Tensor& grad);
  // Collective: whether the gradients the stage 1 hooks copied are still what
  // .grad holds on every rank (see [Note: stage 1 overlap]).
  bool stage1_copies_current();
  void ensure_stage1_grad_shards();
  // A stage-1 gradient shard for group g, from stage1_grad_shard_pool_:
  // zeroed unless its first round writes it.
  at::Tensor new_stage1_grad_shard(size_t g);
  bool uses_gradient_hooks() const {
    return options_.stage() >= 2 || (options_.stage() == 1 && options_.overlap_comm() &&
                                     options_.stage1_reduce_in_backward());
  }
  void on_backward_end(bool outermost);
  at::Tensor take_leftover_grad(size_t group, int64_t index);
  void update_shards(const std::vector<std::vector<bool>>& has_grad);
  // Stages 1-2: launches the all-gather of group g's buckets below `end`
  // not yet launched this step (see [Note: gathers behind the update]).
  void launch_parameter_gathers(size_t g, size_t end);
  // Drops the gathers in flight without waiting; the next launch starts
  // from every group's first bucket.
  void forget_parameter_gathers();
  void gather_parameters();
  // A Communicator over `group` with this optimizer's Gloo choices, for every
  // group it talks over (shard, replica, tensor-parallel).
  std::unique_ptr<Communicator> make_communicator(
      c10::intrusive_ptr<c10d::ProcessGroup> group) const;
  // Where group g's gradient shard is allocated (StatePlacement decides).
  at::TensorOptions grad_shard_options(size_t g) const {
    return placement_->gradient_shard_options(g, shards_[g].grad_options);
  }
  // Bytes of the gradient shards held on the host (on_host) or the device.
  int64_t gradient_shard_bytes(bool on_host) const;
  // Group g's gradient shard's swap space (offload_optimizer.swap_gradients),
  // or null where the shard is a tensor.
  NvmeGradientSwapper* swapped_gradients(size_t g) const {
    NvmeGradientSwapper* swapper = offloaded_ ? offloaded_->gradient_swapper() : nullptr;
    return swapper != nullptr && swapper->swaps(g) ? swapper : nullptr;
  }
  // With gradients in the NVMe swap space: every rank raises an I/O failure
  // any rank kept (see nvme_gradient_swapper.h), naming `what` it stops.
  // Collective there; nothing otherwise.
  void raise_gradient_swap_failure(const std::string& what);
  // Calls fn on [offset, offset + length) of group g's gradient shard, at most
  // kShardChunkElements elements at a time (views of the shard), or
  // kGradientSwapBlockElements (fp32 copies read from its swap space).
  void for_each_gradient_chunk(size_t g, int64_t offset, int64_t length,
                               const std::function<void(const at::Tensor&)>& fn) const;

  InnerOptimizerKind inner_kind_;
  ZeroOptions options_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Communicator> replica_comm_;  // hybrid sharding only
  std::unique_ptr<Communicator> tensor_parallel_comm_;
  std::vector<std::vector<bool>> tensor_parallel_sharded_;                // per group and parameter
  std::vector<std::vector<TensorParallelSplit>> tensor_parallel_splits_;  // empty: not given
  std::unique_ptr<PartitionLayout> layout_;
  std::unique_ptr<StatePlacement> placement_;
  // With offload_optimizer: the master and moments of every group (then
  // GroupShards holds none of them).
  std::unique_ptr<OffloadedOptimizerState> offloaded_;
  // With offload_param on NVMe: the stage-3 parameter shards (then
  // GroupShards::param_shard is undefined).
  std::unique_ptr<NvmeParameterSwapper> param_swapper_;
  // Stage 1's gradient shard lives for a step (or from backward to step()),
  // and a fresh mapping each step faulted its pages in again and made the
  // step time swing (see [Note: the stage-1 shard between steps]).
  HostBufferPool stage1_grad_shard_pool_;
  std::vector<GroupShards> shards_;
  // Stages 1-2: this step's parameter all-gathers in flight (their input is
  // this rank's slice of flat_param), and per group how many buckets have
  // been launched.
  std::vector<PendingCollective> parameter_gathers_;
  std::vector<size_t> parameter_gathers_launched_;
  // With offload the gradient shard holds the reduced sum and this factor
  // (1 / (world size x loss scale), times the clipping coefficient) is
  // applied inside the host kernel's one pass; 1 otherwise.
  double grad_shard_scale_ = 1.0;
  std::unique_ptr<GradientBuckets> buckets_;
  std::unique_ptr<GradientHooks> hooks_;               // stages 2 and 3
  std::unique_ptr<ParameterGatherer> gatherer_;        // stage 3 only
  std::vector<std::vector<at::Tensor>> replacements_;  // see replacement_parameters()
  // Parameter (by TensorImpl) -> (group, index): units and pins name tensors.
  std::unordered_map<const void*, std::pair<size_t, size_t>> param_index_;
  // Per group and parameter: its names (see set_parameter_names); may be empty.
  std::vector<std::vector<std::vector<std::string>>> param_names_;
  struct PendingCheckpoint {
    std::string path;
    std::thread writer;
    std::string error;  // set by the writer: "" on success
  };
  std::unique_ptr<PendingCheckpoint> pending_checkpoint_;  // an asynchronous save in flight
  int64_t saves_started_ = 0;                              // names its store keys
  c10::intrusive_ptr<c10d::Store> checkpoint_store_;       // set_checkpoint_store
  std::string checkpoint_store_prefix_;
  // Output hooks hold a weak reference: they outlive the optimizer harmlessly.
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  // Hooks (backward thread) vs. the training thread; recursive because a
  // gradient hook can complete a bucket whose release the gatherer handles.
  std::recursive_mutex gradient_mutex_;
  c10::Device device_ = c10::Device(c10::kCPU);  // where parameters and state live
  bool gradients_reduced_ = false;               // shards hold the averaged gradient
  double loss_scale_ = 1.0;
  bool last_step_skipped_ = false;
  bool skip_requested_ = false;
  int64_t skipped_steps_ = 0;
  int64_t model_forward_depth_ = 0;  // see model_forward_begin
  bool gradient_sync_ = true;
  bool unsynced_gradients_ = false;  // a backward ran under no_sync since the last reduction
  // Stage 1 overlap: the .grad tensors copied this step and their versions;
  // stale once a second backward ran before the step.
  struct Stage1Copy {
    size_t group;
    int64_t index;
    at::Tensor grad;  // the .grad the hook copied
    int64_t version;  // its version counter then
  };
  std::vector<Stage1Copy> stage1_copied_;
  bool stage1_stale_ = false;
};

}  // namespace zeroshard
