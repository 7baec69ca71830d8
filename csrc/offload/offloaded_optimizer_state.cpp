#include "zeroshard/offloaded_optimizer_state.h"

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
  void wait() {
    if (event_) {
      event_->synchronize();
      event_.reset();
    }
  }

 private:
  std::optional<c10::Event> event_;
};

size_t index_of(OptimizerStateName name) { return static_cast<size_t>(name); }

const char* state_name(OptimizerStateName name) {
  switch (name) {
    case OptimizerStateName::kMaster:
      return "master";
    case OptimizerStateName::kExpAvg:
      return "exp_avg";
    case OptimizerStateName::kExpAvgSq:
      return "exp_avg_sq";
    case OptimizerStateName::kMaxExpAvgSq:
      return "max_exp_avg_sq";
    case OptimizerStateName::kMomentumBuffer:
      return "momentum_buffer";
  }
  return "unknown";
}

template <typename T>
T* at_offset(const at::Tensor& t, int64_t offset) {
  return t.defined() ? t.data_ptr<T>() + offset : nullptr;
}

}  // namespace

OffloadedOptimizerState::OffloadedOptimizerState(const StatePlacement& placement,
                                                 InnerOptimizerKind kind,
                                                 std::vector<c10::ScalarType> param_dtypes)
    : placement_(placement), kind_(kind), param_dtypes_(std::move(param_dtypes)) {
  groups_.resize(placement_.num_groups());
  const int64_t slots = std::min<int64_t>(2, placement_.host_sub_group_count());
  const int64_t numel = placement_.largest_host_sub_group();
  for (int64_t s = 0; s < slots; ++s) {
    staging_.push_back(
        Staging{at::empty({numel}, placement_.options(StateTier::kHost, at::kFloat)),
                at::empty({numel}, placement_.options(StateTier::kHost, param_dtypes_.at(0)))});
  }
}

void OffloadedOptimizerState::initialize_group(size_t g, const at::Tensor& master) {
  at::NoGradGuard no_grad;
  groups_[g].clear();
  for (const SubGroup& where : placement_.sub_groups(g)) {
    SubGroupState state{where, {}};
    at::Tensor& values = state.tensors[index_of(OptimizerStateName::kMaster)];
    values = at::empty({where.numel}, placement_.options(where.tier, at::kFloat));
    values.copy_(master.narrow(0, where.offset, where.numel));
    groups_[g].push_back(std::move(state));
  }
}

void OffloadedOptimizerState::ensure_moments(size_t g, int64_t state_count) {
  std::vector<OptimizerStateName> names;
  if (kind_ == InnerOptimizerKind::kSGD) {
    if (state_count > 0) {
      names.push_back(OptimizerStateName::kMomentumBuffer);
    }
  } else {
    names = {OptimizerStateName::kExpAvg, OptimizerStateName::kExpAvgSq};
    if (state_count == 3) {
      names.push_back(OptimizerStateName::kMaxExpAvgSq);
    }
  }
  for (auto& state : groups_[g]) {
    for (OptimizerStateName name : names) {
      at::Tensor& t = state.tensors[index_of(name)];
      if (!t.defined()) {
        t = at::zeros({state.where.numel}, placement_.options(state.where.tier, at::kFloat));
      }
    }
  }
}

bool OffloadedOptimizerState::has(size_t g, OptimizerStateName name) const {
  return !groups_[g].empty() && groups_[g][0].tensors[index_of(name)].defined();
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
  TORCH_CHECK(has(g, name), "optimizer state '", state_name(name), "' of group ", g,
              " does not exist");
  at::Tensor out = at::empty({length}, options.dtype(at::kFloat));
  for_each_piece(g, offset, length, [&](size_t k, int64_t local, int64_t at, int64_t take) {
    out.narrow(0, at, take).copy_(groups_[g][k].tensors[index_of(name)].narrow(0, local, take));
  });
  return out;
}

void OffloadedOptimizerState::write(size_t g, OptimizerStateName name, int64_t offset,
                                    const at::Tensor& values) {
  at::NoGradGuard no_grad;
  for (auto& state : groups_[g]) {
    at::Tensor& t = state.tensors[index_of(name)];
    if (!t.defined()) {
      t = at::zeros({state.where.numel}, placement_.options(state.where.tier, at::kFloat));
    }
  }
  for_each_piece(g, offset, values.numel(), [&](size_t k, int64_t local, int64_t at, int64_t take) {
    groups_[g][k].tensors[index_of(name)].narrow(0, local, take).copy_(values.narrow(0, at, take));
  });
}

OffloadedOptimizerState::Staging& OffloadedOptimizerState::staging(size_t slot,
                                                                   c10::ScalarType param_dtype) {
  Staging& staging = staging_.at(slot);
  if (staging.params.scalar_type() != param_dtype) {  // groups of another dtype
    staging.params =
        at::empty({staging.grad.numel()}, placement_.options(StateTier::kHost, param_dtype));
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
// pageable memory, every copy is synchronous and the fences do nothing.
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
  auto fetch_gradient = [&](size_t i) {
    const SubGroup& where = sub_groups[host[i]].where;
    Staging& slot = staging(i % slots, param_dtypes_[g]);
    slot.grad.narrow(0, 0, where.numel)
        .copy_(grad_shard.narrow(0, where.offset, where.numel), async);
    grad_ready[i % slots].record(device, async);
  };
  fetch_gradient(0);
  for (size_t i = 0; i < host.size(); ++i) {
    SubGroupState& state = sub_groups[host[i]];
    if (i + 1 < host.size()) {
      fetch_gradient(i + 1);  // its slot's previous reader, the kernel of i - 1, is done
    }
    grad_ready[i % slots].wait();
    params_returned[i % slots].wait();
    const Staging& slot = staging(i % slots, param_dtypes_[g]);
    for (const UpdateRun& run : per_sub_group[host[i]]) {
      run_host_kernel(state, options, run, slot, static_cast<float>(grad_scale));
    }
    for (const UpdateRun& run : per_sub_group[host[i]]) {
      write_parameters(g, run.offset,
                       slot.params.narrow(0, run.offset - state.where.offset, run.length), async);
    }
    params_returned[i % slots].record(device, async);
  }
  for (auto& fence : params_returned) {
    fence.wait();
  }
}

void OffloadedOptimizerState::run_host_kernel(SubGroupState& state,
                                              const torch::optim::OptimizerOptions& options,
                                              const UpdateRun& run, const Staging& staging,
                                              float grad_scale) const {
  const int64_t local = run.offset - state.where.offset;
  auto& t = state.tensors;
  void* param_out =
      static_cast<char*>(staging.params.data_ptr()) + local * staging.params.element_size();
  if (kind_ == InnerOptimizerKind::kSGD) {
    HostSgdArgs args = host_sgd_args(options);
    args.param = at_offset<float>(t[index_of(OptimizerStateName::kMaster)], local);
    args.grad = at_offset<float>(staging.grad, local);
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
  args.grad = at_offset<float>(staging.grad, local);
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
