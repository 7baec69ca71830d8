// ZeroOptimizer's private state and the functions that work on it: the
// class behind zero_optimizer.h's facade. Internal to csrc/optimizer/: the
// public header exposes none of it, so a change here recompiles only this
// folder. Each csrc/optimizer/zero_optimizer_*.cpp file implements one topic
// of it (docs/design.md's file table says which).
#pragma once

#include "../grads/gradient_reduction.h"
#include "background_save.h"
#include "bucket_gathers.h"
#include "device_shard_storage.h"
#include "group_buffers.h"
#include "loss_scaling.h"
#include "parameter_index.h"
#include "parameter_states.h"
#include "stage3_parts.h"
#include "step_phase.h"
#include "zeroshard/checkpoint.h"
#include "zeroshard/communicator.h"
#include "zeroshard/error_agreement.h"
#include "zeroshard/host_syncs.h"
#include "zeroshard/inner_optimizer.h"
#include "zeroshard/mapped_host_memory.h"
#include "zeroshard/nvme_parameter_swapper.h"
#include "zeroshard/offloaded_optimizer_state.h"
#include "zeroshard/optimizer_states.h"
#include "zeroshard/parameter_gatherer.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/process_groups.h"
#include "zeroshard/state_placement.h"
#include "zeroshard/tensor_parallel_split.h"
#include "zeroshard/zero_optimizer.h"
#include "zeroshard/zero_options.h"

#include <torch/csrc/api/include/torch/optim/optimizer.h>
#include <nlohmann/json.hpp>
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

class CheckpointReader;

class ZeroOptimizer::Impl {
 public:
  using LossClosure = torch::optim::Optimizer::LossClosure;

  // Runs the whole construction (zero_optimizer_construction.cpp): a throw
  // leaves nothing behind, as the facade's constructor does.
  Impl(ZeroOptimizer& owner, const torch::optim::OptimizerOptions& inner_defaults,
       ZeroOptions options, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
       c10::intrusive_ptr<c10d::ProcessGroup> replicate_group, std::vector<ParameterUnit> units);
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // ---- What zero_optimizer.h declares and documents ----
  at::Tensor step(LossClosure closure = nullptr);
  void zero_grad(bool set_to_none = true);
  at::Tensor clip_grad_norm(double max_norm);
  at::Tensor gradient_norm();
  void scale_gradients(const at::Tensor& coefficient);
  void set_loss_scale(double scale) { loss_scaling_.set_loss_scale(scale); }
  double loss_scale() const { return loss_scaling_.loss_scale(); }
  bool last_step_skipped() const { return loss_scaling_.last_step_skipped(); }
  void skip_next_step() { loss_scaling_.request_skip(); }
  void check_next_step_for_overflow() { loss_scaling_.request_overflow_check(); }
  int64_t skipped_steps() const { return loss_scaling_.skipped_steps(); }
  void set_gradient_sync(bool enabled) { gradients_->set_sync(enabled); }
  bool gradient_sync() const { return gradients_->sync(); }
  int64_t gradient_bytes() const { return gradients_->device_bytes(); }
  int64_t host_gradient_bytes() const { return gradients_->host_bytes(); }
  int64_t peak_staging_bytes() const { return gradients_->buckets().peak_staging_bytes(); }
  void reset_peak_staging_bytes() { gradients_->buckets().reset_peak_staging_bytes(); }
  int64_t cached_buffer_bytes() const;
  int64_t release_cached_buffers();
  InnerOptimizerKind inner_kind() const { return inner_kind_; }
  // The update rule's name, as checkpoints record it (update_rule_name).
  std::string rule_name() const;
  // An UpdateRule's check of each parameter's shape (check_parameter).
  void check_rule_parameters() const;
  const ZeroOptions& zero_options() const { return options_; }
  const PartitionLayout& layout() const { return *layout_; }
  Communicator& communicator() { return groups_->shard(); }
  Communicator* replica_communicator() { return groups_->replica(); }
  int64_t data_parallel_world_size() const { return groups_->data_parallel_world_size(); }
  void set_tensor_parallel(c10::intrusive_ptr<c10d::ProcessGroup> group,
                           std::vector<std::vector<bool>> sharded,
                           std::vector<std::vector<TensorParallelSplit>> splits = {}) {
    set_model_parallel(ModelParallel::kTensor, std::move(group), std::move(sharded),
                       std::move(splits));
  }
  int64_t checkpoint_rank() const { return groups_->checkpoint_rank(); }
  void set_expert_parallel(c10::intrusive_ptr<c10d::ProcessGroup> group);
  ModelParallel model_parallel() const { return groups_->model_parallel_kind(); }
  void gradient_arrived(size_t group, int64_t index) { gradients_->gradient_arrived(group, index); }
  const at::Tensor& flat_parameters(size_t group) const;
  int64_t optimizer_state_bytes() const;
  int64_t parameter_state_bytes(StateTier tier) const;
  // Where group g's optimizer states live (its first sub-group's tier).
  StateTier state_tier(size_t g) const;
  int64_t device_model_state_bytes() const;
  int64_t host_model_state_bytes() const;
  const StatePlacement& placement() const { return *placement_; }
  const NvmeStateSwapper* nvme_swapper() const { return offloaded_ ? offloaded_->nvme() : nullptr; }
  const NvmeGradientSwapper* gradient_swapper() const {
    return offloaded_ ? offloaded_->gradient_swapper() : nullptr;
  }
  const NvmeParameterSwapper* parameter_swapper() const { return param_swapper_.get(); }
  ShardState shard_state() const;
  void load_shard_state(const ShardState& state);
  ZeroOptimizer::ParameterStatePart parameter_state(size_t group, int64_t index,
                                                    bool read_states) const;
  void write_parameter_state(size_t group, int64_t index, const std::string& name,
                             const at::Tensor& values);
  void set_parameter_names(const std::vector<std::pair<std::string, at::Tensor>>& named) {
    param_index_.set_names(param_groups_, named);
  }
  std::string parameter_name(size_t group, size_t index) const {
    return param_index_.name(group, index);
  }
  std::vector<std::string> parameter_aliases(size_t group, size_t index) const {
    return param_index_.aliases(group, index);
  }
  void save_checkpoint(const std::string& path, const CheckpointSaveOptions& options = {});
  LoadedCheckpoint load_checkpoint(const std::string& path,
                                   const CheckpointLoadOptions& options = {});
  void wait_for_checkpoint();
  bool checkpoint_in_flight() const;
  void set_checkpoint_store(c10::intrusive_ptr<c10d::Store> store, std::string prefix);
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);
  std::vector<std::vector<at::Tensor>> full_parameters(int64_t rank = 0);
  int64_t num_units() const;
  int64_t unit_index(const std::string& name) const;
  void unit_pre_forward(int64_t unit);
  void unit_post_forward(int64_t unit);
  void unit_track_output(int64_t unit, const at::Tensor& output);
  void model_forward_begin();
  void model_forward_end(bool raised = false);
  int64_t agreements() const;
  int64_t diverged_agreements() const;
  void pin_parameters(const std::vector<at::Tensor>& params);
  void unpin_parameters(const std::vector<at::Tensor>& params, int64_t modifier_rank = -1);
  void broadcast_buffers(const std::vector<at::Tensor>& buffers);
  const std::vector<std::vector<at::Tensor>>& replacement_parameters() const {
    return replacements_;
  }
  void adopt_parameters(const std::vector<std::vector<at::Tensor>>& params);
  void begin_initialization(const std::vector<at::Tensor>& params);
  void end_initialization(const std::vector<at::Tensor>& params);
  void finish_initialization(const std::string& local_error);
  int64_t parameter_bytes() const;
  int64_t gathered_parameter_bytes() const;
  int64_t peak_gathered_parameter_bytes() const;
  void reset_peak_gathered_parameter_bytes();

  // ---- The parts of a step, and the state they share ----

  // [Note: the step, owner by owner] (zero_optimizer_step.cpp).
  struct StepAgreement {
    std::vector<std::vector<bool>> has_grad;  // per group and parameter, on any rank
    bool overflow = false;                    // inf/NaN in any rank's gradients
  };
  // The ranks meet, the hyper-parameters are valid and the parameters are
  // where the shards are; returns what could not be re-attached ("" if all).
  std::string begin_step();
  // The step's one flags all-reduce, and the errors every rank raises on it
  // (refused: [Note: the step's phase]; detached: begin_step's).
  StepAgreement agree_on_step(const std::string& refused, const std::string& detached);
  void skip_update();
  void end_step();

  void initialize(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                  c10::intrusive_ptr<c10d::ProcessGroup> replicate_group,
                  std::vector<ParameterUnit> units);
  // set_tensor_parallel and set_expert_parallel: the model-parallel group,
  // which parameters are pieces or a rank's own, and their splits.
  void set_model_parallel(ModelParallel kind, c10::intrusive_ptr<c10d::ProcessGroup> group,
                          std::vector<std::vector<bool>> sharded,
                          std::vector<std::vector<TensorParallelSplit>> splits);
  // ---- Hybrid sharding (zero_optimizer_replicas.cpp); no-ops without it ----
  // A group added after construction (C++ add_param_group is not virtual)
  // has no place in the partition layout: an error, before any collective.
  void check_groups_fixed() const;
  // ---- Tensor parallelism; no-ops without it ----
  // squares: [sum over TP-sharded pieces, sum over the rest] of the reduced
  // gradients' squares on this rank, summed over the data-parallel group;
  // returns the global sum of squares.
  at::Tensor sum_squares_across_tensor_parallel(at::Tensor squares);
  // The shard group's save: what save_checkpoint runs on the first replica.
  void save_checkpoint_shards(const std::string& path, const CheckpointSaveOptions& options);
  std::vector<std::vector<int64_t>> assign_units(const std::vector<ParameterUnit>& units,
                                                 std::vector<std::string>& unit_names,
                                                 std::vector<std::vector<at::Tensor>>& unit_params);
  void build_stage3_shards(size_t group);
  // The gradient path, wired to this optimizer's parts (construction).
  void build_gradient_reduction();
  std::vector<BucketId> buckets_of(const std::vector<at::Tensor>& params) const;
  c10::Device device() const { return device_; }
  void validate_parameters() const;
  // [Note: what the ranks must agree on] (zero_optimizer_validation.cpp).
  void check_layout_agrees_across_ranks();
  // Folded into the step's flags: a hash of every group's hyper-parameters,
  // and the raise, on every rank, naming what differs where.
  int32_t hyperparameter_hash() const;
  void raise_hyperparameter_difference();
  void build_group_shards();
  void ensure_state_tensors(size_t group);
  // This rank's fp32 master values of one bucket (a view, updated in place).
  at::Tensor master_slice(size_t group, const Bucket& bucket);
  // The whole master shard as one contiguous tensor (a copy for fp32 params).
  at::Tensor master_shard(size_t group) const;
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
  nlohmann::json checkpoint_index_skeleton(const CheckpointSaveOptions& options) const;
  // After every rank read a checkpoint without error: every rank read the
  // same index, and under tensor/expert parallelism the ranks agree on the
  // saved grouping and every saved parameter is held by some rank. Raises on
  // every rank otherwise, before anything is loaded.
  void check_checkpoint_agreement(const CheckpointReader& reader, int64_t index_crc,
                                  bool same_grouping, bool with_state);
  // Checkpoints under tensor parallelism (zero_optimizer_tensor_parallel.cpp):
  // where parameter (g, i) sits in its unsplit tensor; whether this rank
  // writes it (a copy is written by tensor-parallel rank 0 only); an error
  // agreed among the writers (ProcessGroups::writers_scope), raised on every
  // rank.
  TensorParallelSplit tensor_parallel_split(size_t g, size_t i) const;
  bool writes_checkpoint_piece(size_t g, size_t i) const;
  void agree_on_checkpoint_errors(const std::string& local_error, const std::string& what);
  // Checkpoints: a range of group g's state `name` in fp32 (a device moment in
  // place, anything else copied to the host).
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
  void finish_gradient_reduction() { gradients_->finish(loss_scaling_.loss_scale()); }
  void update_shards(const std::vector<std::vector<bool>>& has_grad);
  // Stages 1-2: launches the all-gather of group g's buckets below `end`
  // not yet launched this step (see [Note: gathers behind the update]).
  void launch_parameter_gathers(size_t g, size_t end);
  void gather_parameters();
  // A Communicator over `group` with this optimizer's Gloo choices, for every
  // group it talks over (shard, replica, tensor-parallel).
  std::unique_ptr<Communicator> make_communicator(
      c10::intrusive_ptr<c10d::ProcessGroup> group) const;

  // The facade's (torch::optim::Optimizer's) parameter groups: the
  // optimizer's parameters, as the base class and its users see them.
  ZeroOptimizer& owner_;
  std::vector<torch::optim::OptimizerParamGroup>& param_groups_;
  InnerOptimizerKind inner_kind_;
  ZeroOptions options_;
  // Every host sync this optimizer made, by reason ([Note: host syncs,
  // counted]); before groups_, whose communicators count into it.
  mutable HostSyncCounter host_syncs_;  // counted from const reads too
  // The process groups this optimizer talks over (shard, replica,
  // model-parallel) and the agreements over them; set first in initialize().
  std::unique_ptr<ProcessGroups> groups_;
  std::vector<std::vector<bool>> tensor_parallel_sharded_;                // per group and parameter
  std::vector<std::vector<TensorParallelSplit>> tensor_parallel_splits_;  // empty: not given
  std::unique_ptr<PartitionLayout> layout_;
  std::unique_ptr<StatePlacement> placement_;
  // With offload_optimizer: the master and moments of every group (then
  // GroupBuffers holds none of them).
  std::unique_ptr<OffloadedOptimizerState> offloaded_;
  // With offload_param on NVMe: the stage-3 parameter shards (then
  // GroupBuffers::param_shard is undefined).
  std::unique_ptr<NvmeParameterSwapper> param_swapper_;
  std::vector<GroupBuffers> buffers_;
  // The device tier of the states (over buffers_); with offload_optimizer,
  // offloaded_ is the tier that holds them, and the device tier serves only
  // construction's first read of the master. storage() is whichever holds
  // them: [Note: one home for the shard's states] in shard_storage.h.
  std::unique_ptr<DeviceShardStorage> device_storage_;
  // A whole-parameter rule's states of a shape of their own, on the tier of
  // the shard's states ([Note: parameter states] in update_rule.h).
  ParameterStates parameter_states_;
  ShardStorage& storage() const {
    return offloaded_ ? static_cast<ShardStorage&>(*offloaded_) : *device_storage_;
  }
  // Stages 1-2: this step's parameter all-gathers in flight (their input is
  // this rank's slice of flat_param).
  BucketGathers parameter_gathers_;
  std::unique_ptr<ParameterGatherer> gatherer_;            // stage 3 only
  std::unique_ptr<GathererGradientEvents> stage3_events_;  // over gatherer_
  // The gradient path: hooks, buckets, the gradient shards; its mutex is
  // [Note: what the gradient mutex guards]. After gatherer_, which it calls.
  std::unique_ptr<GradientReduction> gradients_;
  std::vector<std::vector<at::Tensor>> replacements_;  // see replacement_parameters()
  // Which parameter a tensor is (units and pins name tensors), and the
  // parameters' names (set_parameter_names).
  ParameterIndex param_index_;
  AsyncCheckpointSaver async_saver_;  // asynchronous checkpoint saves
  // Output hooks hold a weak reference: they outlive the optimizer harmlessly.
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  c10::Device device_ = c10::Device(c10::kCPU);  // where parameters and state live
  LossScaling loss_scaling_;
  StepPhase step_phase_;                 // [Note: the step's phase]
  bool hyperparameters_differ_ = false;  // what the last step's flags found
  int64_t model_forward_depth_ = 0;      // see model_forward_begin
};

}  // namespace zeroshard
