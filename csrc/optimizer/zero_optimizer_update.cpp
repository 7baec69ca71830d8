// The update of the optimizer state shards at the step: contiguous runs of
// owned segments that share a step count, handed to the tier that holds the
// states (ShardStorage::update: the device's ATen path, or the offloaded
// host kernel), whose NVMe failures every rank raises together.
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
  // An update rule of the user's may fail on one rank only: agreed on after
  // every group, as an NVMe failure is.
  const bool rule = inner_kind_ == InnerOptimizerKind::kRule;
  std::string update_error;
  parameter_gathers_.forget();  // none is in flight between steps
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    GroupBuffers& shard = buffers_[g];
    for (size_t i = 0; i < shard.steps.size(); ++i) {
      if (has_grad[g][i]) {
        shard.steps[i] += 1;
      }
    }
    // Runs of owned segments that share a step count and a bucket are
    // updated with one call each, the padding between them included ([Note:
    // aligned slots]: zeros that stay zero); with no skipped parameters that
    // is one call per bucket.
    std::vector<ShardStorage::UpdateRun> runs;
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
      runs.push_back({first.shard_offset, run_end - first.shard_offset, step, first.bucket_index});
      begin = end;
    }
    ShardStorage::UpdateCallbacks callbacks;
    if (!gatherer_) {
      // Stages 1-2: [Note: gathers behind the update].
      callbacks.buckets_updated = [this, g](size_t end) { launch_parameter_gathers(g, end); };
    }
    callbacks.write_parameters = [this, g](int64_t offset, const at::Tensor& values, bool async) {
      write_parameter_values(g, offset, values, async);
    };
    if (rule) {
      callbacks.rule_pieces = [this, g](const std::vector<ShardStorage::UpdateRun>& runs) {
        return device_storage_->rule_pieces(g, runs);
      };
    }
    auto update = [&] {
      storage().update(g, param_groups_[g].options(), runs, gradients_->shard(g),
                       gradients_->shard_scale(), options_.fused(), callbacks);
    };
    if (!nvme && !rule) {
      update();
      continue;
    }
    if (!update_error.empty() && nvme) {
      continue;  // every rank raises it below
    }
    // A rule's failure leaves the later groups to update: their gathers
    // launch on every rank alike (DeviceShardStorage::update).
    try {
      update();
    } catch (const c10::Error& e) {
      if (update_error.empty()) {
        update_error = e.what_without_backtrace();
      }
    } catch (const std::exception& e) {
      if (update_error.empty()) {
        update_error = e.what();
      }
    }
  }
  if (param_swapper_) {
    try {
      param_swapper_->flush();  // the last bucket the step wrote
    } catch (const c10::Error& e) {
      if (update_error.empty()) {
        update_error = e.what_without_backtrace();
      }
    } catch (const std::exception& e) {
      if (update_error.empty()) {
        update_error = e.what();
      }
    }
  }
  if (const NvmeGradientSwapper* grads = gradient_swapper()) {
    if (update_error.empty() && !grads->failure().empty()) {  // e.g. the overflow check's reads
      update_error = grads->failure();
    }
  }
  if (nvme) {
    // An I/O failure on one rank (a damaged swap file, a failing disk) is
    // raised by every rank here, instead of leaving the others to hang in the
    // next collective.
    const std::string agreed = groups_->agree(update_error, "nvme_step");
    TORCH_CHECK(agreed.empty(),
                "could not update the optimizer state or parameters on NVMe (this step is "
                "incomplete; resume from the last checkpoint): ",
                agreed);
  } else if (rule) {
    const std::string agreed = groups_->agree(update_error, "rule_step");
    TORCH_CHECK(agreed.empty(), "the update rule ", rule_name(),
                " failed (this step is incomplete and the ranks' parameters may differ; resume "
                "from the last checkpoint): ",
                agreed);
  }
}

}  // namespace zeroshard
