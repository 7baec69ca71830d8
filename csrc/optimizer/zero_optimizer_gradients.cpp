// ZeroOptimizer: the gradient path. Hooks hand gradients to the buckets, the
// reduction finishes at step() or clip_grad_norm(), the gradient shard holds
// the average; stage 1 reduces from .grad (or during backward, see
// [Note: stage 1 overlap]).
#include "zero_optimizer_impl.h"

#include "zeroshard/mapped_host_memory.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

namespace zeroshard {

void ZeroOptimizer::Impl::clear_gradient_shards() {
  buckets_->wait_all();
  buckets_->reset();
  for (size_t g = 0; g < buffers_.size(); ++g) {
    at::Tensor& shard = buffers_[g].grad_shard;
    if (options_.stage() == 1) {
      shard = at::Tensor();
    } else if (shard.defined() && !buckets_->first_round_writes_shard(g)) {
      // Otherwise the next round overwrites it before anything reads it
      // ([Note: the first round writes the shard]).
      shard.zero_();
    }
  }
  if (offloaded_ && offloaded_->gradient_swapper()) {
    offloaded_->gradient_swapper()->clear();
  }
  gradients_reduced_ = false;
  grad_shard_scale_ = 1.0;
  stage1_copies_.clear();
}

void ZeroOptimizer::Impl::on_gradient(size_t g, int64_t i, const at::Tensor& param) {
  if (!gradient_sync_) {
    unsynced_gradients_ = true;
    return;  // no_sync: the gradient stays in .grad
  }
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) {
    return;
  }
  TORCH_CHECK_VALUE(grad.layout() == c10::kStrided, "parameter ", i, " of group ", g,
                    " has a sparse gradient; zeroshard does not support sparse "
                    "gradients (use a dense embedding: sparse=False)");
  at::NoGradGuard no_grad;
  if (options_.stage() == 1) {
    on_stage1_gradient(g, i, grad);
    return;
  }
  if (groups_->shard().event_log_enabled()) {  // no string building per gradient otherwise
    groups_->shard().note("grad_ready", "group" + std::to_string(g) + "/param" + std::to_string(i));
  }
  if (!buckets_->round_open()) {
    follow_requires_grad(/*outside_backward=*/false);
  }
  buckets_->add_gradient(g, i, grad);
  gradients_reduced_ = false;
  // The full gradient now lives in the bucket; only the shard stays.
  grad.reset();
}

// [Note: stage 1 overlap]
// Stage 1 keeps .grad (local, not averaged, as before), and with overlap_comm
// its hooks also copy each gradient into the buckets, so the reduce-scatters
// run during backward as at stage 2. Two things would make that copy stale,
// and then step() reduces from .grad instead, as without overlap: a second
// synced backward before the step (.grad then holds the sum; every rank runs
// the same backward passes, so every rank sees this at the same hook), and
// any change to a .grad after its hook (an unscale, a clip of the local
// gradients, a replaced tensor), caught by its version counter and agreed
// across ranks in one small all-reduce at the step.
void ZeroOptimizer::Impl::on_stage1_gradient(size_t g, int64_t i, const at::Tensor& grad) {
  if (stage1_copies_.stale()) {
    return;
  }
  if (buckets_->reported(g, i) || (!buckets_->round_open() && buckets_->rounds_since_reset() > 0)) {
    stage1_copies_.mark_stale();  // a second backward since the last step
    return;
  }
  ensure_stage1_grad_shards();
  if (groups_->shard().event_log_enabled()) {
    groups_->shard().note("grad_ready", "group" + std::to_string(g) + "/param" + std::to_string(i));
  }
  stage1_copies_.record(g, i, grad);
  buckets_->add_gradient(g, i, grad);
  gradients_reduced_ = false;
}

void ZeroOptimizer::Impl::ensure_stage1_grad_shards() {
  for (size_t g = 0; g < buffers_.size(); ++g) {
    if (!buffers_[g].grad_shard.defined()) {
      buffers_[g].grad_shard = new_stage1_grad_shard(g);
    }
  }
}

// [Note: the stage-1 shard between steps]
// ZeRO-1 needs the gradient shard only from the reduction to the end of the
// update. It used to be a mapping of its own each step, unmapped when the
// step ended: every step then faulted Psi/N x 4 bytes in again, and on 2 CPU
// ranks the step phase swung between 180 and 560 ms from one step to the next
// (benchmarks/results/step_time_changes.md). It now comes from a pool of its
// own: freed when the step ends as before (gradient_bytes() does not count it
// between steps), but the mapping is kept for the next step, counted by cached_buffer_bytes()
// and given back by release_cached_buffers(), as CUDA's caching allocator
// keeps the same shard on a GPU until torch.cuda.empty_cache().
at::Tensor ZeroOptimizer::Impl::new_stage1_grad_shard(size_t g) {
  at::Tensor shard =
      stage1_grad_shard_pool_.empty(layout_->group(g).shard_numel(), grad_shard_options(g));
  // Zeros only where a round adds into it ([Note: the first round writes
  // the shard]): a shard is allocated after reset(), before its first round.
  return buckets_->first_round_writes_shard(g) ? shard : shard.zero_();
}

bool ZeroOptimizer::Impl::stage1_copies_current() {
  // A .grad set where no hook fired, replaced, or changed in place.
  const bool current = stage1_copies_.match(param_groups_);
  at::Tensor stale = at::tensor({current ? 0 : 1}, at::kInt);
  groups_->shard().all_reduce_on_host(stale, c10d::ReduceOp::MAX, "stage1_overlap_check");
  groups_->max_across_replicas(stale, "stage1_overlap_check");
  return stale.item<int32_t>() == 0;
}

at::Tensor ZeroOptimizer::Impl::take_leftover_grad(size_t g, int64_t i) {
  at::Tensor& grad = param_groups_[g].params()[i].mutable_grad();
  at::Tensor taken = grad;
  grad.reset();
  return taken;
}

void ZeroOptimizer::Impl::on_backward_end(bool outermost) {
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::NoGradGuard no_grad;
  bool join_round = false;
  if (gatherer_) {
    // Agreed reductions and other ranks' gathers until every rank's backward
    // ended; the buckets left then are flushed in one order everywhere.
    join_round = gatherer_->wait_for_all_ranks(outermost ? AgreementBarrier::kBackwardEnd
                                                         : AgreementBarrier::kInnerBackwardEnd);
  }
  if (gradient_sync_ && !(options_.stage() == 1 && stage1_copies_.stale())) {
    // Another rank's backward delivered gradients and this one's none (data
    // took it past every trainable parameter): it runs the same round, its
    // buckets all zeros, as the others flush theirs.
    if (join_round) {
      buckets_->require_round();
    }
    // Stage 1 keeps .grad; stages 2 and 3 move what is left into the buckets.
    buckets_->flush(
        [this](size_t g, int64_t i) {
          return options_.stage() == 1 ? param_groups_[g].params()[i].grad()
                                       : take_leftover_grad(g, i);
        },
        /*force_round=*/join_round);
    buckets_->wait_all();
  }
  // An inner (reentrant checkpoint) backward must not release what the
  // outer backward still needs.
  if (gatherer_ && outermost) {
    gatherer_->backward_finished();
  }
}

void ZeroOptimizer::Impl::finish_gradient_reduction() {
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  if (gradients_reduced_) {
    return;
  }
  at::NoGradGuard no_grad;
  follow_requires_grad(/*outside_backward=*/false);  // before this round, if none is open
  bool reduced_in_backward = false;
  if (options_.stage() == 1 && hooks_) {
    // A rank whose backward delivered no gradient issues the round the others
    // issued during backward now, before the check that every rank makes.
    ensure_stage1_grad_shards();
    buckets_->flush([this](size_t g, int64_t i) { return param_groups_[g].params()[i].grad(); },
                    /*force_round=*/true);
    buckets_->wait_all();
    reduced_in_backward = stage1_copies_current();
  }
  if (reduced_in_backward) {
    // The hooks reduced during backward (see [Note: stage 1 overlap]).
  } else if (options_.stage() == 1) {
    // Full gradients are in .grad; feed them in flat-buffer order so buckets
    // complete, and launch, one after another.
    clear_gradient_shards();
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      buffers_[g].grad_shard = new_stage1_grad_shard(g);
    }
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      const auto& params = param_groups_[g].params();
      for (const ParamSlot& slot : layout_->group(g).slots()) {
        const at::Tensor& grad = params[slot.param_index].grad();
        if (!grad.defined()) {
          continue;
        }
        TORCH_CHECK_VALUE(grad.layout() == c10::kStrided, "parameter ", slot.param_index,
                          " of group ", g,
                          " has a sparse gradient; zeroshard does not support sparse "
                          "gradients (use a dense embedding: sparse=False)");
        TORCH_CHECK_VALUE(grad.sizes() == params[slot.param_index].sizes(),
                          "gradient of parameter ", slot.param_index, " of group ", g,
                          " has shape ", grad.sizes(), " but the parameter has shape ",
                          params[slot.param_index].sizes());
        buckets_->add_gradient(g, slot.param_index, grad);
      }
    }
    buckets_->flush(nullptr, /*force_round=*/true);
  } else {
    // Gradients still in .grad (accumulated under no_sync) and buckets not yet
    // launched go now; a rank whose backward produced no gradient at all still
    // issues the round the other ranks issued. no_sync after a synced pass
    // needs a round of its own (every rank ran the same passes).
    if (unsynced_gradients_) {
      buckets_->require_round();
      unsynced_gradients_ = false;
    }
    buckets_->flush([this](size_t g, int64_t i) { return take_leftover_grad(g, i); },
                    /*force_round=*/true);
  }
  buckets_->wait_all();
  raise_gradient_swap_failure("reduce the gradients");
  reduce_gradient_shards_across_replicas();
  // Gloo has no AVG: sum, then divide (what the buckets did not divide
  // before: [Note: pre-divided 16-bit gradients]); and undo the loss scale.
  // With offload the host kernel applies the factor in its one pass over the
  // gradient.
  const double ranks = options_.gradient_divide_factor() > 0
                           ? options_.gradient_divide_factor()
                           : static_cast<double>(data_parallel_world_size());
  const double divisor = ranks * loss_scaling_.loss_scale() / buckets_->predivide();
  if (offloaded_) {
    grad_shard_scale_ = 1.0 / divisor;
  } else if (divisor != 1.0) {
    for (auto& shard : buffers_) {
      shard.grad_shard.div_(divisor);
    }
  }
  gradients_reduced_ = true;
}

void ZeroOptimizer::Impl::for_each_gradient_chunk(
    size_t g, int64_t offset, int64_t length,
    const std::function<void(const at::Tensor&)>& fn) const {
  NvmeGradientSwapper* swapped = swapped_gradients(g);
  const at::Tensor& shard = buffers_[g].grad_shard;
  if (!swapped && !shard.defined()) {
    return;  // stage 1 before its first reduction: no gradient yet
  }
  // A swapped shard is read a block at a time: each read is a transient of
  // its own, kept to the size of the blocks the swap already holds.
  const int64_t chunk = swapped ? kGradientSwapBlockElements : kShardChunkElements;
  for (int64_t done = 0; done < length; done += chunk) {
    const int64_t numel = std::min(chunk, length - done);
    fn(swapped ? swapped->read(g, offset + done, numel) : shard.narrow(0, offset + done, numel));
  }
}

void ZeroOptimizer::Impl::raise_gradient_swap_failure(const std::string& what) {
  const NvmeGradientSwapper* swapper = gradient_swapper();
  if (swapper == nullptr) {
    return;
  }
  const std::string agreed = groups_->agree(swapper->failure(), "nvme_gradients");
  TORCH_CHECK(agreed.empty(), "could not ", what,
              ": the gradient shard in the NVMe swap space failed (this step's gradients are "
              "lost; zero_grad() and redo the step, or resume from the last checkpoint): ",
              agreed);
}

}  // namespace zeroshard
