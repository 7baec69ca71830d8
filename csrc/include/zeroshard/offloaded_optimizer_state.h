// The optimizer state of one rank when offload_optimizer is on: the fp32
// master and the moments of each sub-group, on the tier StatePlacement gives
// it, and the offloaded step.
//
// The step, per sub-group (see [Note: offloaded step] in the .cpp): the host
// kernel reads the sub-group's gradient from the host fp32 gradient shard (or,
// for a group partly on the device, from a host staging buffer it was copied
// to), updates master and moments in one fused pass and writes the
// parameter copy in the parameters' dtype into a staging buffer, and that
// goes back to the device.
//
// [Note: gradients to the host]
// A group whose sub-groups are all offloaded keeps its gradient shard in
// host memory (StatePlacement::gradient_shard_on_host): each bucket's reduced
// slice goes there as soon as its reduce-scatter is waited on, during
// backward (HostShardReceiver: on CUDA a non-blocking copy on a side stream
// into pinned memory), so the device holds no gradient shard, only the
// buckets in flight, and the step starts
// with every gradient already on the host. With 'cpu' offload the shard is
// fp32 and the kernel reads it in place; with 'nvme' it keeps the reduced
// dtype (host RAM is what NVMe offload saves; a 16-bit shard is half an fp32
// one) and goes through the fp32 staging slots like a device shard. Two buffers of each kind
// alternate, so on CUDA with pinned memory the copies of one sub-group overlap the update of the
// next. Sub-groups that stay on the device (ratio < 1) run the ATen path of inner_optimizer.h
// instead. Sub-groups on NVMe run the same host kernel on states the NvmeStateSwapper brings in and
// writes back around each update.
#pragma once

#include "zeroshard/host_syncs.h"
#include "zeroshard/inner_optimizer.h"
#include "zeroshard/nvme_gradient_swapper.h"
#include "zeroshard/nvme_state_swapper.h"
#include "zeroshard/optimizer_states.h"
#include "zeroshard/shard_storage.h"
#include "zeroshard/state_placement.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace zeroshard {

// The host and NVMe tier of ShardStorage ([Note: one home for the shard's
// states] in shard_storage.h), and the offloaded step.
class OffloadedOptimizerState final : public ShardStorage {
 public:
  // Writes `values` (a 1D tensor, any device, the parameters' dtype) into the
  // parameter copy the device uses, at shard offset `offset` of group
  // `group`. May copy asynchronously from `values`: see step().
  using WriteParameters =
      std::function<void(size_t group, int64_t offset, const at::Tensor& values, bool async)>;

  // With NVMe sub-groups, `nvme_states` (the master plus the most moments
  // any group uses) slots are reserved per sub-group in `rank`'s swap file.
  OffloadedOptimizerState(const StatePlacement& placement, InnerOptimizerKind kind,
                          std::vector<c10::ScalarType> param_dtypes, int64_t rank = 0,
                          const AioOptions& aio = AioOptions(), int64_t nvme_states = 0);

  // Allocates group `group`'s master from `master` (1D fp32, the whole
  // shard, any device); ensure_states adds the moments.
  void initialize_group(size_t group, const at::Tensor& master);
  // The same without values: the group's sub-groups hold no state until
  // written, so the master can be written piece by piece (write) and the
  // whole fp32 shard never needs to be in memory at once.
  void prepare_group(size_t group);

  // ShardStorage. Calling ensure_states again adds moments that are missing
  // (amsgrad turned on) and keeps the rest.
  void ensure_states(size_t group, const std::vector<OptimizerStateName>& names) override;
  bool has(size_t group, OptimizerStateName name) const override;
  at::Tensor read(size_t group, OptimizerStateName name, int64_t offset, int64_t length,
                  const at::TensorOptions& options) const override;
  void write(size_t group, OptimizerStateName name, int64_t offset,
             const at::Tensor& values) override;
  int64_t bytes(StateTier tier) const override;
  c10::Device home_device() const override { return c10::Device(c10::kCPU); }

  void update(size_t group, const torch::optim::OptimizerOptions& options,
              const std::vector<UpdateRun>& runs, const at::Tensor& grad_shard, double grad_scale,
              bool fused, const UpdateCallbacks& callbacks) override {
    if (kind_ == InnerOptimizerKind::kRule) {
      step_by_rule(group, static_cast<const RuleOptions&>(options), runs, grad_shard, grad_scale,
                   callbacks);
      return;
    }
    step(group, options, runs, grad_shard, grad_scale, fused,
         [&callbacks](size_t, int64_t offset, const at::Tensor& values, bool async) {
           callbacks.write_parameters(offset, values, async);
         });
  }
  // Updates group `group` over `runs` (sorted by offset): gradient =
  // grad_shard * grad_scale, then write_parameters with each run's new
  // parameter values. Returns when every copy has completed.
  void step(size_t group, const torch::optim::OptimizerOptions& options,
            const std::vector<UpdateRun>& runs, const at::Tensor& grad_shard, double grad_scale,
            bool fused, const WriteParameters& write_parameters);

  // bytes(tier): state plus staging buffers (kNVMe: the swap file; its host
  // buffers count as kHost).
  // The NVMe tier's swapper (telemetry), or null.
  const NvmeStateSwapper* nvme() const { return swapper_.get(); }
  // Counts the step's waits for device copies (null: not counted).
  void set_host_sync_counter(HostSyncCounter* counter) { host_syncs_ = counter; }
  // The gradient shards of groups StatePlacement::swaps_gradients, or null:
  // the buckets write into it, the step reads from it (see
  // nvme_gradient_swapper.h).
  NvmeGradientSwapper* gradient_swapper() const { return gradient_swapper_.get(); }

 private:
  struct SubGroupState {
    SubGroup where;
    // By OptimizerStateName (a rule's own states after the built-in ones).
    // NVMe sub-groups: views of a swap buffer during their update only;
    // undefined otherwise.
    std::vector<at::Tensor> tensors;
    size_t swap_index = 0;  // NVMe: the sub-group's index in the swapper
  };
  struct Staging {
    // fp32; only where a group's gradient shard is not read in place (page
    // aligned, with the swap reads' margin, when gradients are swapped).
    at::Tensor grad;
    at::Tensor params;  // the group's parameter dtype
  };

  // Calls fn(sub-group, offset in it, offset in the range, length) for each
  // piece of [offset, offset + length).
  template <typename F>
  void for_each_piece(size_t group, int64_t offset, int64_t length, F&& fn) const;
  void step_on_device(SubGroupState& state, const torch::optim::OptimizerOptions& options,
                      const std::vector<UpdateRun>& runs, const at::Tensor& grad_shard,
                      double grad_scale, bool fused, const WriteParameters& write_parameters);
  // [Note: a rule on the host]
  void step_by_rule(size_t group, const RuleOptions& options, const std::vector<UpdateRun>& runs,
                    const at::Tensor& grad_shard, double grad_scale,
                    const UpdateCallbacks& callbacks);
  void run_host_kernel(SubGroupState& state, const torch::optim::OptimizerOptions& options,
                       const UpdateRun& run, const Staging& staging, const float* grad,
                       float grad_scale) const;
  Staging& staging(size_t slot, c10::ScalarType param_dtype);
  class SwappedIn {
   public:
    SwappedIn(OffloadedOptimizerState& owner, SubGroupState& state, size_t position);
    ~SwappedIn();
    SwappedIn(const SwappedIn&) = delete;
    SwappedIn& operator=(const SwappedIn&) = delete;
    void write_back();

   private:
    void unbind();
    OffloadedOptimizerState& owner_;
    SubGroupState& state_;
    size_t position_;
    bool active_ = false;
  };
  bool on_nvme(const SubGroupState& state) const { return state.where.tier == StateTier::kNVMe; }
  bool present(const SubGroupState& state, OptimizerStateName name) const;
  // The swap slot of a state (the master is slot 0; -1: no room reserved).
  int64_t swap_slot(OptimizerStateName name) const;
  // Throws when group `g` has NVMe sub-groups and no slot for `name`.
  void check_swap_room(size_t g, OptimizerStateName name) const;

  const StatePlacement& placement_;
  InnerOptimizerKind kind_;
  std::vector<c10::ScalarType> param_dtypes_;
  std::vector<std::vector<SubGroupState>> groups_;
  std::vector<Staging> staging_;  // two slots, or one with a single host sub-group
  std::unique_ptr<NvmeStateSwapper> swapper_;
  HostSyncCounter* host_syncs_ = nullptr;
  std::unique_ptr<NvmeGradientSwapper> gradient_swapper_;
  std::vector<size_t> first_swap_index_;  // per group: its first NVMe sub-group's swap index
};

}  // namespace zeroshard
