#include "zeroshard/offloaded_optimizer_state.h"

#include "zeroshard/mapped_host_memory.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>

namespace zeroshard {
namespace {

// Completion of an asynchronous copy on the device's current stream; a
// no-op when copies are synchronous (CPU devices, pageable host memory).
class CopyFence {
 public:
  void record(const c10::Device& device, bool async) {
    if (!async) {
      return;
    }
    event_.emplace(device.type());
    event_->record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
  }
  void wait(HostSyncCounter* counter, HostSync reason) {
    if (event_) {
      if (counter != nullptr) {
        counter->count(reason);
      }
      event_->synchronize();
      event_.reset();
    }
  }

 private:
  std::optional<c10::Event> event_;
};

size_t index_of(OptimizerStateName name) { return static_cast<size_t>(name); }

template <typename T>
T* at_offset(const at::Tensor& t, int64_t offset) {
  return t.defined() ? t.data_ptr<T>() + offset : nullptr;
}

}  // namespace

OffloadedOptimizerState::OffloadedOptimizerState(const StatePlacement& placement,
                                                 InnerOptimizerKind kind,
                                                 std::vector<c10::ScalarType> param_dtypes,
                                                 int64_t rank, const AioOptions& aio,
                                                 int64_t nvme_states)
    : placement_(placement), kind_(kind), param_dtypes_(std::move(param_dtypes)) {
  groups_.resize(placement_.num_groups());
  std::vector<int64_t> nvme_numels;
  for (size_t g = 0; g < placement_.num_groups(); ++g) {
    first_swap_index_.push_back(nvme_numels.size());
    for (const SubGroup& where : placement_.sub_groups(g)) {
      if (where.tier == StateTier::kNVMe) {
        nvme_numels.push_back(where.numel);
      }
    }
  }
  if (!nvme_numels.empty()) {
    TORCH_INTERNAL_ASSERT(nvme_states >= 1, "NVMe sub-groups need their state count");
    swapper_ = std::make_unique<NvmeStateSwapper>(placement_.offload_optimizer(), aio, rank,
                                                  std::move(nvme_numels), nvme_states);
  }
  std::vector<int64_t> swapped_gradients(placement_.num_groups(), 0);
  bool swaps_gradients = false;
  for (size_t g = 0; g < placement_.num_groups(); ++g) {
    if (placement_.swaps_gradients(g)) {
      for (const SubGroup& where : placement_.sub_groups(g)) {
        swapped_gradients[g] += where.numel;
      }
      swaps_gradients = true;
    }
  }
  if (swaps_gradients) {
    gradient_swapper_ = std::make_unique<NvmeGradientSwapper>(placement_.offload_optimizer(), aio,
                                                              rank, std::move(swapped_gradients));
  }
  const int64_t slots = std::min<int64_t>(2, placement_.host_sub_group_count());
  const int64_t numel = placement_.largest_host_sub_group();
  for (int64_t s = 0; s < slots; ++s) {
    at::Tensor grad;
    if (swaps_gradients) {
      // The swap file's reads go straight into it (the direct path).
      grad = mapped_host_empty(NvmeGradientSwapper::read_capacity(numel), at::kFloat);
    } else if (placement_.stages_gradients()) {
      grad = at::empty({numel}, placement_.options(StateTier::kHost, at::kFloat));
    }
    staging_.push_back(Staging{
        grad, at::empty({numel}, placement_.options(StateTier::kHost, param_dtypes_.at(0)))});
  }
}

void OffloadedOptimizerState::prepare_group(size_t g) {
  groups_[g].clear();
  size_t swap_index = first_swap_index_.at(g);
  for (const SubGroup& where : placement_.sub_groups(g)) {
    SubGroupState state{where, std::vector<at::Tensor>(kBuiltinOptimizerStates), 0};
    if (on_nvme(state)) {
      state.swap_index = swap_index++;
      for (int64_t slot = 0; slot < swapper_->states_per_sub_group(); ++slot) {
        swapper_->drop(state.swap_index, slot);
      }
    }
    groups_[g].push_back(std::move(state));
  }
}

void OffloadedOptimizerState::initialize_group(size_t g, const at::Tensor& master) {
  at::NoGradGuard no_grad;
  prepare_group(g);
  write(g, OptimizerStateName::kMaster, 0, master);
}

void OffloadedOptimizerState::check_swap_room(size_t g, OptimizerStateName name) const {
  const bool any_on_nvme = std::any_of(groups_[g].begin(), groups_[g].end(),
                                       [&](const SubGroupState& s) { return on_nvme(s); });
  TORCH_CHECK(!any_on_nvme || swap_slot(name) >= 0, "optimizer state '", optimizer_state_name(name),
              "' has no room in the NVMe swap space, which was reserved at construction for "
              "the states the hyper-parameters needed then (amsgrad turned on later, or a "
              "checkpoint saved with amsgrad?); construct the optimizer with amsgrad=True");
}

bool OffloadedOptimizerState::present(const SubGroupState& state, OptimizerStateName name) const {
  if (!on_nvme(state)) {
    return index_of(name) < state.tensors.size() && state.tensors[index_of(name)].defined();
  }
  const int64_t slot = swap_slot(name);
  return slot >= 0 && swapper_->present(state.swap_index, slot);
}

int64_t OffloadedOptimizerState::swap_slot(OptimizerStateName name) const {
  int64_t slot = -1;
  switch (name) {
    case OptimizerStateName::kMaster:
      slot = 0;
      break;
    case OptimizerStateName::kMomentumBuffer:
      slot = kind_ == InnerOptimizerKind::kSGD ? 1 : -1;
      break;
    case OptimizerStateName::kExpAvg:
      slot = kind_ == InnerOptimizerKind::kSGD ? -1 : 1;
      break;
    case OptimizerStateName::kExpAvgSq:
      slot = kind_ == InnerOptimizerKind::kSGD ? -1 : 2;
      break;
    case OptimizerStateName::kMaxExpAvgSq:
      slot = kind_ == InnerOptimizerKind::kSGD ? -1 : 3;
      break;
  }
  return slot < (swapper_ ? swapper_->states_per_sub_group() : 0) ? slot : -1;
}

void OffloadedOptimizerState::ensure_states(size_t g,
                                            const std::vector<OptimizerStateName>& names) {
  for (OptimizerStateName name : names) {
    check_swap_room(g, name);  // before anything changes
  }
  for (auto& state : groups_[g]) {
    for (OptimizerStateName name : names) {
      if (on_nvme(state)) {
        const int64_t slot = swap_slot(name);
        if (!swapper_->present(state.swap_index, slot)) {
          swapper_->mark_zero(state.swap_index, slot);
        }
        continue;
      }
      if (state.tensors.size() <= index_of(name)) {
        state.tensors.resize(index_of(name) + 1);
      }
      at::Tensor& t = state.tensors[index_of(name)];
      if (!t.defined()) {
        t = at::zeros({state.where.numel}, placement_.options(state.where.tier, at::kFloat));
      }
    }
  }
}

bool OffloadedOptimizerState::has(size_t g, OptimizerStateName name) const {
  return !groups_[g].empty() && present(groups_[g][0], name);
}

template <typename F>
void OffloadedOptimizerState::for_each_piece(size_t g, int64_t offset, int64_t length,
                                             F&& fn) const {
  const auto& sub_groups = groups_[g];
  // Sub-groups are sorted and contiguous: the first one containing `offset`.
  auto it = std::upper_bound(
      sub_groups.begin(), sub_groups.end(), offset,
      [](int64_t value, const SubGroupState& s) { return value < s.where.offset; });
  TORCH_INTERNAL_ASSERT(it != sub_groups.begin() || length == 0, "offset ", offset,
                        " before the first sub-group");
  if (it != sub_groups.begin()) {
    --it;
  }
  int64_t done = 0;
  for (; it != sub_groups.end() && done < length; ++it) {
    const SubGroup& where = it->where;
    const int64_t begin = offset + done;
    const int64_t local = begin - where.offset;
    const int64_t take = std::min(length - done, where.numel - local);
    fn(static_cast<size_t>(it - sub_groups.begin()), local, done, take);
    done += take;
  }
  TORCH_INTERNAL_ASSERT(done == length, "range [", offset, ", ", offset + length,
                        ") extends past the shard");
}

at::Tensor OffloadedOptimizerState::read(size_t g, OptimizerStateName name, int64_t offset,
                                         int64_t length, const at::TensorOptions& options) const {
  TORCH_CHECK(has(g, name), "optimizer state '", optimizer_state_name(name), "' of group ", g,
              " does not exist");
  check_swap_room(g, name);
  at::Tensor out = at::empty({length}, options.dtype(at::kFloat));
  for_each_piece(g, offset, length, [&](size_t k, int64_t local, int64_t at, int64_t take) {
    const SubGroupState& state = groups_[g][k];
    out.narrow(0, at, take)
        .copy_(on_nvme(state) ? swapper_->read(state.swap_index, swap_slot(name), local, take)
                              : state.tensors[index_of(name)].narrow(0, local, take));
  });
  return out;
}

void OffloadedOptimizerState::write(size_t g, OptimizerStateName name, int64_t offset,
                                    const at::Tensor& values) {
  at::NoGradGuard no_grad;
  ensure_states(g, {name});  // checks the swap room before anything changes
  for_each_piece(g, offset, values.numel(), [&](size_t k, int64_t local, int64_t at, int64_t take) {
    SubGroupState& state = groups_[g][k];
    if (on_nvme(state)) {
      swapper_->write(state.swap_index, swap_slot(name), local, values.narrow(0, at, take));
    } else {
      state.tensors[index_of(name)].narrow(0, local, take).copy_(values.narrow(0, at, take));
    }
  });
}

OffloadedOptimizerState::Staging& OffloadedOptimizerState::staging(size_t slot,
                                                                   c10::ScalarType param_dtype) {
  Staging& staging = staging_.at(slot);
  if (staging.params.scalar_type() != param_dtype) {  // groups of another dtype
    staging.params =
        at::empty({staging.params.numel()}, placement_.options(StateTier::kHost, param_dtype));
  }
  return staging;
}

int64_t OffloadedOptimizerState::bytes(StateTier tier) const {
  int64_t total = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) {
      total += t.numel() * static_cast<int64_t>(t.element_size());
    }
  };
  for (const auto& group : groups_) {
    for (const auto& state : group) {
      if (state.where.tier == tier) {
        for (const auto& t : state.tensors) {
          add(t);
        }
      }
    }
  }
  if (tier == StateTier::kHost) {
    for (const auto& staging : staging_) {
      add(staging.grad);
      add(staging.params);
    }
    total += swapper_ ? swapper_->buffer_bytes() : 0;
  }
  if (tier == StateTier::kNVMe && swapper_) {
    total += swapper_->disk_bytes();
  }
  return total;
}

// [Note: offloaded step]
// Host sub-groups run in order through two staging slots. For sub-group i:
// its gradient was copied into slot i % 2 while sub-group i - 1 was updated
// (the copy of sub-group 0 goes first); the kernel waits for that copy and
// for the return copy that last used the slot's parameter buffer (sub-group
// i - 2), updates master and moments in one pass, writes the new parameter
// values into the slot, and starts their copy back. With a CPU device, or
// pageable memory, every copy is synchronous and the fences do nothing. A
// group whose gradient shard is on the host (every sub-group offloaded) has
// no gradient copies: the kernel reads the shard in place (see
// [Note: gradients to the host] in the header).
void OffloadedOptimizerState::step(size_t g, const torch::optim::OptimizerOptions& options,
                                   const std::vector<UpdateRun>& runs, const at::Tensor& grad_shard,
                                   double grad_scale, bool fused,
                                   const WriteParameters& write_parameters) {
  at::NoGradGuard no_grad;
  auto& sub_groups = groups_[g];
  std::vector<std::vector<UpdateRun>> per_sub_group(sub_groups.size());
  for (const UpdateRun& run : runs) {
    for_each_piece(
        g, run.offset, run.length, [&](size_t k, int64_t local, int64_t /*at*/, int64_t take) {
          per_sub_group[k].push_back(UpdateRun{sub_groups[k].where.offset + local, take, run.step});
        });
  }
  std::vector<size_t> host;
  for (size_t k = 0; k < sub_groups.size(); ++k) {
    if (per_sub_group[k].empty()) {
      continue;
    }
    if (sub_groups[k].where.tier == StateTier::kDevice) {
      step_on_device(sub_groups[k], options, per_sub_group[k], grad_shard, grad_scale, fused,
                     write_parameters);
    } else {
      host.push_back(k);
    }
  }
  if (host.empty()) {
    return;
  }
  const bool async = placement_.asynchronous_copies(StateTier::kHost, /*for_parameters=*/false);
  const c10::Device device = placement_.device();
  const size_t slots = staging_.size();
  std::array<CopyFence, 2> grad_ready;
  std::array<CopyFence, 2> params_returned;
  // [Note: gradients to the host]: the kernel reads a host shard in place.
  const bool in_place = placement_.reads_gradient_in_place(g);
  TORCH_INTERNAL_ASSERT(
      !in_place || (grad_shard.is_cpu() && grad_shard.scalar_type() == at::kFloat &&
                    grad_shard.is_contiguous()),
      "a host gradient shard must be a contiguous fp32 CPU tensor");
  // A swapped gradient shard is read from disk a sub-group ahead, like a
  // device shard's copy; the values start `lead` elements into the slot.
  const bool swapped = placement_.swaps_gradients(g);
  std::array<IoTicket, 2> grad_read{0, 0};
  std::array<int64_t, 2> grad_lead{0, 0};
  auto fetch_gradient = [&](size_t i) {
    if (in_place) {
      return;
    }
    const SubGroup& where = sub_groups[host[i]].where;
    Staging& slot = staging(i % slots, param_dtypes_[g]);
    if (swapped) {
      grad_read[i % slots] =
          gradient_swapper_->submit_read(g, where.offset, where.numel, slot.grad.data_ptr<float>());
      grad_lead[i % slots] = NvmeGradientSwapper::read_lead(where.offset);
      return;
    }
    slot.grad.narrow(0, 0, where.numel)
        .copy_(grad_shard.narrow(0, where.offset, where.numel), async);
    grad_ready[i % slots].record(device, async);
  };
  // NVMe sub-groups, in the order they update: see [Note: NVMe step pipeline].
  std::vector<size_t> swap_order;
  std::vector<size_t> swap_position(host.size(), 0);
  for (size_t i = 0; i < host.size(); ++i) {
    if (on_nvme(sub_groups[host[i]])) {
      swap_position[i] = swap_order.size();
      swap_order.push_back(sub_groups[host[i]].swap_index);
    }
  }
  // An exception below (an I/O failure) must not leave transfers in flight
  // into the swap buffers: they complete, and their own errors are dropped.
  struct AbandonOnUnwind {
    NvmeStateSwapper* swapper;
    NvmeGradientSwapper* gradients;
    std::array<IoTicket, 2>& reads;
    ~AbandonOnUnwind() {
      if (swapper != nullptr) {
        swapper->abandon();
      }
      for (IoTicket ticket : reads) {
        try {
          if (gradients != nullptr) {
            gradients->wait_read(ticket);
          }
        } catch (...) {
          // The step that raised reports its own failure.
        }
      }
    }
  } unwind{swap_order.empty() ? nullptr : swapper_.get(), gradient_swapper_.get(), grad_read};
  if (!swap_order.empty()) {
    swapper_->begin(swap_order);
  }
  fetch_gradient(0);
  for (size_t i = 0; i < host.size(); ++i) {
    SubGroupState& state = sub_groups[host[i]];
    if (i + 1 < host.size()) {
      fetch_gradient(i + 1);  // its slot's previous reader, the kernel of i - 1, is done
    }
    SwappedIn swapped_in(*this, state, swap_position[i]);
    grad_ready[i % slots].wait(host_syncs_, HostSync::kOffloadGradientCopy);
    if (swapped) {
      const IoTicket ticket = grad_read[i % slots];
      grad_read[i % slots] = 0;
      gradient_swapper_->wait_read(ticket);
    }
    params_returned[i % slots].wait(host_syncs_, HostSync::kOffloadUpdate);
    const Staging& slot = staging(i % slots, param_dtypes_[g]);
    const float* grad = in_place ? grad_shard.data_ptr<float>() + state.where.offset
                                 : slot.grad.data_ptr<float>() + grad_lead[i % slots];
    for (const UpdateRun& run : per_sub_group[host[i]]) {
      run_host_kernel(state, options, run, slot, grad, static_cast<float>(grad_scale));
    }
    for (const UpdateRun& run : per_sub_group[host[i]]) {
      write_parameters(g, run.offset,
                       slot.params.narrow(0, run.offset - state.where.offset, run.length), async);
    }
    params_returned[i % slots].record(device, async);
    swapped_in.write_back();
  }
  for (auto& fence : params_returned) {
    fence.wait(host_syncs_, HostSync::kOffloadUpdate);
  }
  if (!swap_order.empty()) {
    swapper_->finish();
  }
  unwind.swapper = nullptr;
  unwind.gradients = nullptr;
}

// An NVMe sub-group's states bound to its swap buffer for its update; on a
// host sub-group, nothing. write_back() starts their write; an exception
// before it leaves the states unbound and the file as it was.
OffloadedOptimizerState::SwappedIn::SwappedIn(OffloadedOptimizerState& owner, SubGroupState& state,
                                              size_t position)
    : owner_(owner), state_(state), position_(position) {
  if (!owner_.on_nvme(state_)) {
    return;
  }
  active_ = true;
  const std::vector<at::Tensor> views = owner_.swapper_->acquire(position_);
  for (size_t k = 0; k < state_.tensors.size(); ++k) {
    const int64_t slot = owner_.swap_slot(static_cast<OptimizerStateName>(k));
    if (slot >= 0) {
      state_.tensors[k] = views[slot];
    }
  }
}

void OffloadedOptimizerState::SwappedIn::write_back() {
  if (!active_) {
    return;
  }
  std::vector<bool> now_present(owner_.swapper_->states_per_sub_group(), false);
  for (size_t k = 0; k < state_.tensors.size(); ++k) {
    const int64_t slot = owner_.swap_slot(static_cast<OptimizerStateName>(k));
    if (slot >= 0 && state_.tensors[k].defined()) {
      now_present[slot] = true;
    }
  }
  unbind();
  owner_.swapper_->release(position_, now_present);
}

void OffloadedOptimizerState::SwappedIn::unbind() {
  for (auto& t : state_.tensors) {
    t.reset();
  }
  active_ = false;
}

OffloadedOptimizerState::SwappedIn::~SwappedIn() {
  if (active_) {
    unbind();
  }
}

// [Note: a rule on the host]
// An UpdateRule (Muon, a torch.optim class) runs on the host as on the
// device: on its pieces of the group's shard, here views of the host master,
// gradient and states. Its group is one sub-group (StatePlacement), so each
// piece's values are contiguous, a whole parameter's included. The gradient
// is read in place when the group's shard is on the host (every 'cpu'
// offloaded group); the new values go back to the parameters run by run.
void OffloadedOptimizerState::step_by_rule(size_t g, const RuleOptions& options,
                                           const std::vector<UpdateRun>& runs,
                                           const at::Tensor& grad_shard, double grad_scale,
                                           const UpdateCallbacks& callbacks) {
  at::NoGradGuard no_grad;
  TORCH_INTERNAL_ASSERT(groups_[g].size() <= 1, "a rule's offloaded group is one sub-group");
  if (runs.empty() || groups_[g].empty()) {
    return;
  }
  SubGroupState& state = groups_[g][0];
  TORCH_INTERNAL_ASSERT(!on_nvme(state), "a rule's states are not swapped to NVMe");
  const std::vector<OptimizerStateName> names = rule_states(options);
  ensure_states(g, names);
  const at::Tensor& master = state.tensors[index_of(OptimizerStateName::kMaster)];
  if (grad_shard.device() != master.device() && host_syncs_ != nullptr) {
    host_syncs_->count(HostSync::kOffloadGradientCopy);  // a blocking copy to the host
  }
  at::Tensor grad = grad_shard.to(master.device(), at::kFloat);
  if (grad_scale != 1.0) {
    // Scaled in the host copy where .to() made one (a device's or a 16-bit
    // shard); the reduction's own fp32 host shard is not ours to change.
    const bool copied = !grad.is_same(grad_shard);
    grad = copied ? grad.mul_(grad_scale) : grad.mul(grad_scale);
  }
  std::vector<ParameterShard> pieces;
  for (RulePiece& piece : callbacks.rule_pieces(runs)) {
    ParameterShard& out = piece.parameter;
    out.param = master.narrow(0, piece.shard_offset, piece.numel);
    out.grad = grad.narrow(0, piece.shard_offset, piece.numel);
    for (OptimizerStateName name : names) {
      out.states.push_back(
          state.tensors[index_of(name)].narrow(0, piece.shard_offset, piece.numel));
    }
    pieces.push_back(std::move(out));
  }
  if (!pieces.empty()) {
    options.rule()->update(options.hyperparameters(), pieces);
  }
  if (master.device() != placement_.device() && host_syncs_ != nullptr) {
    host_syncs_->count(HostSync::kOffloadUpdate);  // the blocking copies back
  }
  for (const UpdateRun& run : runs) {
    callbacks.write_parameters(
        run.offset, master.narrow(0, run.offset, run.length).to(param_dtypes_[g]), false);
  }
}

void OffloadedOptimizerState::run_host_kernel(SubGroupState& state,
                                              const torch::optim::OptimizerOptions& options,
                                              const UpdateRun& run, const Staging& staging,
                                              const float* grad, float grad_scale) const {
  const int64_t local = run.offset - state.where.offset;
  auto& t = state.tensors;
  void* param_out =
      static_cast<char*>(staging.params.data_ptr()) + local * staging.params.element_size();
  if (kind_ == InnerOptimizerKind::kSGD) {
    HostSgdArgs args = host_sgd_args(options);
    args.param = at_offset<float>(t[index_of(OptimizerStateName::kMaster)], local);
    args.grad = grad + local;
    args.momentum_buffer =
        at_offset<float>(t[index_of(OptimizerStateName::kMomentumBuffer)], local);
    args.param_out = param_out;
    args.out_dtype = staging.params.scalar_type();
    args.numel = run.length;
    args.grad_scale = grad_scale;
    args.step = run.step;
    host_sgd_step(args);
    return;
  }
  HostAdamArgs args = host_adam_args(kind_, options);
  args.param = at_offset<float>(t[index_of(OptimizerStateName::kMaster)], local);
  args.grad = grad + local;
  args.exp_avg = at_offset<float>(t[index_of(OptimizerStateName::kExpAvg)], local);
  args.exp_avg_sq = at_offset<float>(t[index_of(OptimizerStateName::kExpAvgSq)], local);
  args.max_exp_avg_sq = at_offset<float>(t[index_of(OptimizerStateName::kMaxExpAvgSq)], local);
  args.param_out = param_out;
  args.out_dtype = staging.params.scalar_type();
  args.numel = run.length;
  args.grad_scale = grad_scale;
  args.step = run.step;
  host_adam_step(args);
}

void OffloadedOptimizerState::step_on_device(SubGroupState& state,
                                             const torch::optim::OptimizerOptions& options,
                                             const std::vector<UpdateRun>& runs,
                                             const at::Tensor& grad_shard, double grad_scale,
                                             bool fused, const WriteParameters& write_parameters) {
  const SubGroup& where = state.where;
  at::Tensor grad = grad_shard.narrow(0, where.offset, where.numel).to(at::kFloat);
  if (grad_scale != 1.0) {
    grad = grad.mul(grad_scale);
  }
  auto& t = state.tensors;
  for (const UpdateRun& run : runs) {
    const int64_t local = run.offset - where.offset;
    auto slice = [&](const at::Tensor& x) {
      return x.defined() ? x.narrow(0, local, run.length) : at::Tensor();
    };
    ShardView view{slice(t[index_of(OptimizerStateName::kMaster)]),
                   slice(grad),
                   slice(t[index_of(OptimizerStateName::kExpAvg)]),
                   slice(t[index_of(OptimizerStateName::kExpAvgSq)]),
                   slice(t[index_of(OptimizerStateName::kMaxExpAvgSq)]),
                   slice(t[index_of(OptimizerStateName::kMomentumBuffer)])};
    apply_inner_update(kind_, options, view, run.step, fused);
    write_parameters(where.group, run.offset, view.param.to(param_dtypes_[where.group]),
                     /*async=*/false);
  }
}

}  // namespace zeroshard
