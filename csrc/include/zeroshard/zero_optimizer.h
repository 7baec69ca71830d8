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
#include "zeroshard/host_syncs.h"
#include "zeroshard/inner_optimizer.h"
#include "zeroshard/model_parallel.h"
#include "zeroshard/parameter_unit.h"
#include "zeroshard/tensor_parallel_split.h"
#include "zeroshard/zero_options.h"

#include <torch/csrc/api/include/torch/optim/optimizer.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

class Communicator;
class NvmeGradientSwapper;
class NvmeParameterSwapper;
class NvmeStateSwapper;
class PartitionLayout;
class StatePlacement;

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
  double loss_scale() const;
  // Whether the last step() found non-finite gradients (skip_nonfinite_steps)
  // and left every parameter and state unchanged; and how many did so far.
  bool last_step_skipped() const;
  // The next step() skips as for non-finite gradients, whatever it finds:
  // for a decision taken over several optimizers (zeroshard.clip_grad_norm_
  // found their joint norm non-finite), so all skip together. Every rank
  // must call it alike.
  void skip_next_step();
  // The next step() checks the reduced gradients for inf/NaN and is skipped
  // on every rank if any rank's hold one, as every step is with
  // skip_nonfinite_steps: for a loss scaler of the caller's (Python's
  // torch.amp.GradScaler). Every rank must call it alike.
  void check_next_step_for_overflow();
  int64_t skipped_steps() const;

  // While false (stage 2), backward passes leave gradients accumulating in
  // .grad with no communication, as DDP's no_sync(); the next backward with
  // sync on (or step()) reduces them.
  void set_gradient_sync(bool enabled);
  bool gradient_sync() const;

  // Bytes of gradient storage held now on the training device: the gradient
  // shard, staging buffers alive, and any .grad still set on the parameters.
  // A gradient shard in host memory (offload) counts in
  // host_gradient_bytes() and host_model_state_bytes() instead.
  int64_t gradient_bytes() const;
  int64_t host_gradient_bytes() const;
  // Largest staging-buffer footprint since construction or the last reset.
  int64_t peak_staging_bytes() const;
  void reset_peak_staging_bytes();
  // Host buffers kept from one step to the next (gradient staging,
  // reduce-scatter outputs and receive rows; see mapped_host_memory.h), at
  // most one step's peak.
  int64_t cached_buffer_bytes() const;
  // Unmaps them, as torch.cuda.empty_cache does for CUDA's cache (e.g. before
  // an evaluation that needs the memory); the next step maps afresh. Returns
  // the bytes given back. Local: no collective.
  int64_t release_cached_buffers();

  InnerOptimizerKind inner_kind() const;
  const ZeroOptions& zero_options() const;
  const PartitionLayout& layout() const;
  // The shard group's communicator, and the replicate group's (null without
  // hybrid sharding).
  Communicator& communicator();
  Communicator* replica_communicator();
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
  // Which of the two the model-parallel group is (set_tensor_parallel or
  // set_expert_parallel); kNone before either.
  using ModelParallel = ::zeroshard::ModelParallel;
  ModelParallel model_parallel() const;
  // This rank's number in checkpoints: among the ranks that write one (the
  // first replica's shard group times the tensor-parallel group) it names
  // the data file; the other replicas' ranks follow. Names RNG files.
  int64_t checkpoint_rank() const;
  // Expert parallelism: this optimizer's parameters are this rank's own
  // experts, other tensors on every rank of `group` (the expert-parallel
  // group; the process group above is the experts' data-parallel group).
  // Their gradient norms add up over `group`, a non-finite gradient on any
  // rank skips the step on all of them, and checkpoints keep each rank's
  // experts under their own names. Collective over `group` from then on:
  // call it on every rank, before the first step.
  void set_expert_parallel(c10::intrusive_ptr<c10d::ProcessGroup> group);
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
  const StatePlacement& placement() const;
  // With offload_optimizer on NVMe: the swap space's telemetry; else null.
  const NvmeStateSwapper* nvme_swapper() const;
  // With offload_optimizer.swap_gradients: the gradient swap space; else null.
  const NvmeGradientSwapper* gradient_swapper() const;
  // With offload_param on NVMe (stage 3): the parameter swap space; else null.
  const NvmeParameterSwapper* parameter_swapper() const;

  // torch.optim's optimizer.state[p] for parameter `index` of group `group`:
  // this rank's part of it. See [Note: optimizer.state, this rank's part] in
  // shard_state.cpp.
  struct ParameterStatePart {
    int64_t param_offset = 0;  // first owned element of the flattened parameter
    int64_t numel = 0;         // owned elements; 0 where this rank owns none
    int64_t steps = 0;         // updates applied to the parameter so far
    ShardState states;         // torch.optim's names: fp32 copies of the owned elements
  };
  // With read_states false, only where the part lies and the steps.
  ParameterStatePart parameter_state(size_t group, int64_t index, bool read_states = true) const;
  // Writes `values` (numel of the owned part, any dtype and device) into the
  // state `name` of this rank's part of the parameter: the core's state,
  // used by the next step(). Local: no collective.
  void write_parameter_state(size_t group, int64_t index, const std::string& name,
                             const at::Tensor& values);

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

  // Every time this optimizer made the host wait for the device since
  // construction, by reason ("step_flags", "clip_coefficient", ...: see
  // [Note: host syncs, counted] in host_syncs.h). Counted whatever the device,
  // so a CPU run shows what a GPU run pays.
  std::map<std::string, int64_t> host_sync_counts() const;
  // Where they are counted: code around the optimizer (the engine) that
  // reads device data counts its reads here too.
  HostSyncCounter& host_sync_counter();
  // The group host knowledge (agreements, flags, error strings) travels over
  // for the shard group: see [Note: the host channel] in communicator.h. A
  // group with a CPU backend is its own; for an NCCL-only group pass a Gloo
  // group over the same ranks (make_gloo_process_group). Null: none, host
  // data then goes through the device and each exchange is a host sync.
  // Collective in effect: every rank sets the same kind of channel.
  void set_host_channel(c10::intrusive_ptr<c10d::ProcessGroup> group);

  // Collective. Gathers the buckets holding `params` (all parameters when
  // empty) and keeps them gathered until unpin_parameters. With
  // modifier_rank >= 0, unpinning broadcasts that rank's values and stores
  // them in the shards (edits made while gathered persist); with hybrid
  // sharding, modifier_rank is a rank of the first replica's shard group and
  // every replica gets its values. Any stage: at stages 1 and 2 parameters
  // are always gathered, so only the broadcast acts.
  void pin_parameters(const std::vector<at::Tensor>& params);
  void unpin_parameters(const std::vector<at::Tensor>& params, int64_t modifier_rank = -1);

  // Collective. Copies broadcast_from_rank's values of the model's buffers
  // (with hybrid sharding, the first replica's) into every rank's, in place,
  // as DistributedDataParallel does when it wraps a model: a buffer
  // initialised differently on each rank (an unseeded random init) would
  // otherwise stay different. Every rank passes the same buffers in the same
  // order. The Python optimizer calls it when it is given module=, and
  // attach_units does for torch::nn models.
  void broadcast_buffers(const std::vector<at::Tensor>& buffers);

  // Partitioned construction: when the parameters were on the meta device,
  // the tensors to use instead (same shapes, on materialize_device, views of
  // the released bucket buffers), per group; undefined where the parameter
  // was not meta. Put them in the model, then call adopt_parameters.
  const std::vector<std::vector<at::Tensor>>& replacement_parameters() const;
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
  // Everything else: the state and the parts of a step
  // (csrc/optimizer/zero_optimizer_impl.h).
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
