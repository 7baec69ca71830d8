// ZeroOptimizer: clipping and the step's flags. The global gradient norm
// over the reduced shards (every group, every tier, the tensor- or
// expert-parallel pieces), the scaling that clips, and the one all-reduce of
// flags before each step: which parameters had a gradient on any rank,
// whether any rank's gradients overflowed, whether any parameter left the
// optimizer's storage.
#include "zero_optimizer_impl.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/any.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/logical_or.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <vector>

namespace zeroshard {

at::Tensor ZeroOptimizer::Impl::clip_grad_norm(double max_norm) {
  TORCH_CHECK_VALUE(max_norm > 0, "max_norm must be > 0, got ", max_norm);
  at::Tensor total_norm = gradient_norm();
  // As torch.nn.utils.clip_grad_norm_ (Python's scalar / tensor is
  // reciprocal() * scalar), coefficient clamped at 1.
  scale_gradients(total_norm.add(1e-6).reciprocal().mul(max_norm).clamp_max(1.0));
  return total_norm;
}

at::Tensor ZeroOptimizer::Impl::gradient_norm() {
  finish_gradient_reduction();
  at::NoGradGuard no_grad;
  // [pieces of tensor-parallel splits, everything else]: see set_tensor_parallel.
  at::Tensor squares = at::zeros({2}, fp32_options());
  for (size_t g = 0; g < buffers_.size(); ++g) {
    const GroupBuffers& shard = buffers_[g];
    if (!groups_->model_parallel()) {
      gradients_->for_each_chunk(
          g, 0, layout_->group(g).shard_numel(),
          [&](const at::Tensor& chunk) { squares[1].add_(chunk.to(at::kFloat).pow(2).sum()); });
      continue;
    }
    for (const ShardSegment& segment : shard.segments) {
      const bool split = tensor_parallel_sharded_[g][segment.param_index];
      gradients_->for_each_chunk(g, segment.shard_offset, segment.numel,
                                 [&](const at::Tensor& chunk) {
                                   squares[split ? 0 : 1].add_(chunk.to(at::kFloat).pow(2).sum());
                                 });
    }
  }
  gradients_->raise_swap_failure("take the gradient norm");
  groups_->shard().all_reduce_sum(squares, "grad_norm");
  at::Tensor total_norm = sum_squares_across_tensor_parallel(squares).sqrt();
  if (offloaded_) {
    total_norm.mul_(gradients_->shard_scale());  // the shard holds unscaled sums
  }
  return total_norm;
}

at::Tensor ZeroOptimizer::Impl::sum_squares_across_tensor_parallel(at::Tensor squares) {
  if (groups_->model_parallel()) {
    at::Tensor pieces = squares.narrow(0, 0, 1).clone();
    groups_->model_parallel()->all_reduce_sum(
        pieces, std::string(groups_->model_parallel_tag()) + "grad_norm");
    squares.narrow(0, 0, 1).copy_(pieces);
  }
  return squares.sum();
}

void ZeroOptimizer::Impl::scale_gradients(const at::Tensor& coefficient) {
  finish_gradient_reduction();
  gradients_->scale(coefficient);
}

std::vector<std::vector<bool>> ZeroOptimizer::Impl::global_grad_presence(bool* overflow,
                                                                         bool detached,
                                                                         bool* any_detached) {
  int64_t total = 0;
  for (const auto& group : param_groups_) {
    total += static_cast<int64_t>(group.params().size());
  }
  // Then: this rank's reduced gradients hold inf/NaN; one of its parameters
  // left the optimizer's storage; its hyper-parameters' hash and the hash's
  // complement ([Note: what the ranks must agree on]). Host knowledge,
  // exchanged over the host channel, but for the one read of the device's
  // inf/NaN flag (see [Note: host syncs, counted]).
  at::Tensor flags = at::zeros({total + 4}, at::kInt);
  auto* data = flags.data_ptr<int32_t>();
  data[total + 1] = detached ? 1 : 0;
  const int32_t hyperparameters = hyperparameter_hash();
  data[total + 2] = hyperparameters;
  data[total + 3] = ~hyperparameters;
  if (options_.skip_nonfinite_steps() || loss_scaling_.overflow_check_requested()) {
    // Accumulated on the device, chunk by chunk, and read once: a read per
    // chunk would wait for the device once per chunk.
    at::Tensor nonfinite;
    for (size_t g = 0; g < buffers_.size(); ++g) {
      gradients_->for_each_chunk(
          g, 0, layout_->group(g).shard_numel(), [&](const at::Tensor& chunk) {
            at::Tensor here = at::isfinite(chunk).logical_not().any();
            nonfinite =
                nonfinite.defined() ? nonfinite.logical_or(here.to(nonfinite.device())) : here;
          });
    }
    if (nonfinite.defined()) {
      data[total] =
          read_to_host(nonfinite, &host_syncs_, HostSync::kStepFlags).item<bool>() ? 1 : 0;
    }
  }
  int64_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i, ++index) {
      data[index] = gradients_->reported(g, static_cast<int64_t>(i)) ? 1 : 0;
    }
  }
  groups_->shard().all_reduce_on_host(flags, c10d::ReduceOp::MAX, "grad_presence");
  groups_->max_across_replicas(flags, "grad_presence");  // a parameter unused on one replica only
  // inf/NaN in one piece skips the step on every piece; presence stays this
  // rank's own (under expert parallelism the group's ranks hold other
  // parameters at the same indices).
  at::Tensor overflow_flag = flags.narrow(0, total, 2).clone();
  groups_->max_across_model_parallel(overflow_flag, "overflow");
  flags.narrow(0, total, 2).copy_(overflow_flag);
  data = flags.data_ptr<int32_t>();
  *overflow = data[total] != 0;
  *any_detached = data[total + 1] != 0;
  hyperparameters_differ_ = data[total + 2] != ~data[total + 3];
  std::vector<std::vector<bool>> has_grad(param_groups_.size());
  index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i, ++index) {
      has_grad[g].push_back(data[index] != 0);
    }
  }
  return has_grad;
}

}  // namespace zeroshard
