// The step: zero_grad, step() (reduce, check, clip, update, gather) and, at
// stages 1-2, the parameter all-gathers launched behind the update.
#include "zero_optimizer_impl.h"

#include "../checkpoint/checkpoint_detail.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <unordered_map>

namespace zeroshard {
// [Note: the step, owner by owner]
// Read top to bottom, a step is: the ranks meet (stage 3's barrier) and the
// parameters are checked; the gradient path (GradientReduction) finishes its
// reduction; one host all-reduce of the step's flags (presence, overflow,
// hyper-parameter hash) decides together whether and what to update; the
// loss scaling (LossScaling) records it; the clip scales the gradient shards;
// the storage tiers update the shards (update_shards: the device tier here,
// OffloadedOptimizerState with offload); the parameters are gathered again
// (stages 1-2: behind the update; stage 3: ParameterGatherer); the gradient
// path is cleared for the next backward.
at::Tensor ZeroOptimizer::Impl::step(LossClosure closure) {
  // Everything the step allocates or launches belongs on the parameters'
  // device, whatever device the caller left current.
  const c10::OptionalDeviceGuard on_parameters_device(device_);
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  // [Note: the step's phase]: an earlier incomplete step is refused on every
  // rank by the agreement below.
  const std::string refused = step_phase_.begin();
  try {
    const std::string detached = begin_step();
    finish_gradient_reduction();
    const StepAgreement agreed = agree_on_step(refused, detached);
    if (!loss_scaling_.record_step(agreed.overflow)) {
      if (options_.max_norm() > 0) {
        clip_grad_norm(options_.max_norm());
      }
      step_phase_.start_update();
      try {
        update_shards(agreed.has_grad);
      } catch (...) {
        // Gathers launched before the failure are retired; a later gather
        // (a checkpoint load) must launch every bucket again.
        parameter_gathers_.forget();
        throw;
      }
      gather_parameters();
    } else {
      skip_update();  // every rank saw the overflow: nothing is updated anywhere
    }
    end_step();
  } catch (const c10::Error& e) {
    step_phase_.failed(e.what_without_backtrace());
    throw;
  } catch (const std::exception& e) {
    step_phase_.failed(e.what());
    throw;
  } catch (...) {
    step_phase_.failed("an exception that is not a std::exception");
    throw;
  }
  step_phase_.end();
  return loss;
}

std::string ZeroOptimizer::Impl::begin_step() {
  check_groups_fixed();
  if (gatherer_) {
    // A rank still in a forward or backward pass gets its gathers served
    // until it arrives (see [Note: Negotiated collectives]).
    std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
    gatherer_->wait_for_all_ranks(AgreementBarrier::kStep);
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    // Hyper-parameters may have been edited since the last step (schedulers).
    validate_inner_options(inner_kind_, param_groups_[g].options());
    ensure_state_tensors(g);
  }
  return reattach_parameters();
}

ZeroOptimizer::Impl::StepAgreement ZeroOptimizer::Impl::agree_on_step(const std::string& refused,
                                                                      const std::string& detached) {
  StepAgreement agreed;
  bool any_refused = false;
  agreed.has_grad =
      global_grad_presence(&agreed.overflow, !(refused + detached).empty(), &any_refused);
  if (any_refused) {
    // Every rank saw the flag; the ranks whose state is incomplete say why.
    const std::string incomplete = groups_->agree(refused, "incomplete_state");
    TORCH_CHECK(incomplete.empty(), "zeroshard: step() refused ", incomplete);
  }
  if (hyperparameters_differ_) {
    raise_hyperparameter_difference();  // every rank saw it; the gradients stay
  }
  if (any_refused) {
    // Every rank saw the flag; the names come from the ranks that have them.
    // Nothing is updated and the gradients stay for a retry.
    const std::string names = groups_->agree(detached, "detached_parameters");
    TORCH_CHECK(false, "zeroshard: step() refused ", names);
  }
  return agreed;
}

void ZeroOptimizer::Impl::skip_update() {
  if (param_swapper_) {
    param_swapper_->end_iteration();
  }
  if (gatherer_) {
    gatherer_->after_step();
  }
}

void ZeroOptimizer::Impl::end_step() {
  groups_->shard().set_step(groups_->shard().step() + 1);
  // The step consumes the gradients.
  std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
  gradients_->clear();
  gradients_->follow_requires_grad(/*outside_backward=*/true);
}

void ZeroOptimizer::Impl::zero_grad(bool set_to_none) {
  owner_.torch::optim::Optimizer::zero_grad(set_to_none);
  gradients_->zero_grad();
}

void ZeroOptimizer::Impl::gather_parameters() {
  if (gatherer_) {
    if (param_swapper_) {
      param_swapper_->end_iteration();  // the step wrote every shard
    }
    for (auto& shard : buffers_) {
      const at::Tensor& master = shard.state(OptimizerStateName::kMaster);
      if (master.defined()) {  // 16-bit parameters: send the rounded master
        shard.param_shard.copy_(master);
      }
    }
    gatherer_->after_step();
    return;
  }
  try {
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      launch_parameter_gathers(g, layout_->group(g).buckets().size());
    }
  } catch (...) {
    parameter_gathers_.forget();
    throw;
  }
  parameter_gathers_.wait_all();
}

// [Note: gathers behind the update]
// At stages 1-2 a bucket's all-gather can start as soon as this rank's slice
// of it is updated: update_shards launches each bucket's gather when the
// update moves past it, so the communication of bucket b overlaps the update
// of b + 1 (the update walks the shard in bucket order), and the rest of a
// group's before the next group's, so every rank issues them in (group,
// bucket) order. gather_parameters launches what is left (every bucket,
// with offload) and waits for all. A failed update drops the gathers it
// launched without waiting (the other ranks then fail in theirs, bounded by
// the process-group timeout, as with any failure between collectives).
void ZeroOptimizer::Impl::launch_parameter_gathers(size_t g, size_t end) {
  const GroupLayout& layout = layout_->group(g);
  GroupBuffers& shard = buffers_[g];
  parameter_gathers_.launch(g, end, [&](size_t b) {
    const Bucket& bucket = layout.buckets()[b];
    // Gathered from this rank's own slice of flat_param: the fp32 master is
    // that slice (written in place by the update), a 16-bit one is rounded
    // into it here, and with offload the step already wrote it.
    at::Tensor input = shard.flat_param.narrow(
        0, layout.rank_slice_offset(bucket, groups_->shard().rank()), bucket.shard_numel);
    if (!offloaded_) {
      const at::Tensor master = master_slice(g, bucket);
      if (!master.is_alias_of(input)) {
        input.copy_(master);
      }
    }
    at::Tensor output = shard.flat_param.narrow(0, bucket.flat_offset, bucket.numel);
    return groups_->shard().all_gather(output, input, bucket_tag(g, b));
  });
}

}  // namespace zeroshard
