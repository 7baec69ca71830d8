// The update of the optimizer state shards at the step: contiguous runs of
// owned segments that share a step count, through the ATen path of
// inner_optimizer.h or, with offload, OffloadedOptimizerState (whose NVMe
// failures every rank raises together).
#include "zero_optimizer_impl.h"

#include "../checkpoint/checkpoint_detail.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <vector>

namespace zeroshard {

void ZeroOptimizer::Impl::update_shards(const std::vector<std::vector<bool>>& has_grad) {
  // The step's NVMe transfers: the optimizer state's, and the parameter
  // shards it writes with offload_param on NVMe.
  const bool nvme = swaps_to_nvme();
  std::string nvme_error;
  parameter_gathers_.forget();  // none is in flight between steps
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    GroupBuffers& shard = buffers_[g];
    const auto& group_options = param_groups_[g].options();
    for (size_t i = 0; i < shard.steps.size(); ++i) {
      if (has_grad[g][i]) {
        shard.steps[i] += 1;
      }
    }
    // With offload the gradient stays as reduced until the host copy. A
    // 16-bit gradient is widened a chunk at a time below: a whole-shard fp32
    // copy was 4 bytes per shard element on top of the model states, the
    // largest transient of a stage 3 step.
    const bool widen = !offloaded_ && shard.grad_shard.scalar_type() != at::kFloat;
    std::vector<OffloadedOptimizerState::UpdateRun> runs;
    // Runs of owned segments that share a step count and a bucket are
    // updated with one call each, the padding between them included ([Note:
    // aligned slots]: zeros that stay zero); with no skipped parameters that
    // is one call per bucket.
    const auto& segments = shard.segments;
    size_t begin = 0;
    while (begin < segments.size()) {
      const ShardSegment& first = segments[begin];
      if (!has_grad[g][first.param_index]) {
        ++begin;
        continue;
      }
      const int64_t step = shard.steps[first.param_index];
      size_t end = begin + 1;
      int64_t run_end = first.shard_offset + first.numel;
      while (end < segments.size() && has_grad[g][segments[end].param_index] &&
             shard.steps[segments[end].param_index] == step &&
             segments[end].bucket_index == first.bucket_index) {
        run_end = segments[end].shard_offset + segments[end].numel;
        ++end;
      }
      const int64_t offset = first.shard_offset;
      const int64_t length = run_end - offset;
      begin = end;
      if (offloaded_) {
        runs.push_back(OffloadedOptimizerState::UpdateRun{offset, length, step});
        continue;
      }
      if (!gatherer_) {  // the buckets before this run are complete
        launch_parameter_gathers(g, static_cast<size_t>(first.bucket_index));
      }
      const Bucket& bucket = layout_->group(g).buckets()[first.bucket_index];
      at::Tensor master = master_slice(g, bucket).narrow(0, offset - bucket.shard_offset, length);
      // The update is elementwise: chunks of a run give the values the whole
      // run would.
      const int64_t chunk = widen ? kShardChunkElements : length;
      for (int64_t done = 0; done < length; done += chunk) {
        const int64_t numel = std::min(chunk, length - done);
        auto part = [&](const at::Tensor& t) {
          return t.defined() ? t.narrow(0, offset + done, numel) : at::Tensor();
        };
        at::Tensor grad = part(shard.grad_shard);
        ShardView view{master.narrow(0, done, numel),
                       widen ? grad.to(at::kFloat) : grad,
                       part(shard.state(OptimizerStateName::kExpAvg)),
                       part(shard.state(OptimizerStateName::kExpAvgSq)),
                       part(shard.state(OptimizerStateName::kMaxExpAvgSq)),
                       part(shard.state(OptimizerStateName::kMomentumBuffer))};
        apply_inner_update(inner_kind_, group_options, view, step, options_.fused());
      }
    }
    if (!offloaded_ && !gatherer_) {
      // The rest of this group's buckets, before the next group's: which
      // buckets a rank's runs fall in depends on its slice and on skipped
      // parameters, but the order of the gathers must not.
      launch_parameter_gathers(g, layout_->group(g).buckets().size());
    }
    if (offloaded_ && nvme_error.empty()) {
      auto write = [this](size_t group, int64_t offset, const at::Tensor& values, bool async) {
        write_parameter_values(group, offset, values, async);
      };
      if (!nvme) {
        offloaded_->step(g, group_options, runs, shard.grad_shard, grad_shard_scale_,
                         options_.fused(), write);
        continue;
      }
      try {
        offloaded_->step(g, group_options, runs, shard.grad_shard, grad_shard_scale_,
                         options_.fused(), write);
      } catch (const c10::Error& e) {
        nvme_error = e.what_without_backtrace();
      } catch (const std::exception& e) {
        nvme_error = e.what();
      }
    }
  }
  if (param_swapper_) {
    try {
      param_swapper_->flush();  // the last bucket the step wrote
    } catch (const c10::Error& e) {
      if (nvme_error.empty()) {
        nvme_error = e.what_without_backtrace();
      }
    } catch (const std::exception& e) {
      if (nvme_error.empty()) {
        nvme_error = e.what();
      }
    }
  }
  if (const NvmeGradientSwapper* grads = gradient_swapper()) {
    if (nvme_error.empty() && !grads->failure().empty()) {  // e.g. the overflow check's reads
      nvme_error = grads->failure();
    }
  }
  if (nvme) {
    // An I/O failure on one rank (a damaged swap file, a failing disk) is
    // raised by every rank here, instead of leaving the others to hang in the
    // next collective.
    const std::string agreed = groups_->agree(nvme_error, "nvme_step");
    TORCH_CHECK(agreed.empty(),
                "could not update the optimizer state or parameters on NVMe (this step is "
                "incomplete; resume from the last checkpoint): ",
                agreed);
  }
}

}  // namespace zeroshard
