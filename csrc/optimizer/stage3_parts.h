// Stage 3's parts between the optimizer's owners, named rather than lambdas
// in construction: where a gather's shard comes from (Stage3ShardSource) and
// the gatherer's part in the gradient path (GathererGradientEvents).
// Internal to csrc/optimizer/.
#pragma once

#include "../grads/gradient_reduction.h"
#include "group_buffers.h"
#include "zeroshard/host_syncs.h"
#include "zeroshard/nvme_parameter_swapper.h"
#include "zeroshard/parameter_gatherer.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/state_placement.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace zeroshard {

// This rank's slice of bucket (g, b), on the device, in the parameters'
// dtype: what its all-gather sends (ParameterGatherer::ShardOf). From the
// parameter shard on the device, in host memory (offload_param 'cpu') or in
// the swap space ('nvme').
class Stage3ShardSource {
 public:
  // The swapper is read through its owner's pointer: it is made after the
  // gatherer that holds this source.
  Stage3ShardSource(const PartitionLayout& layout, const StatePlacement& placement,
                    const std::vector<GroupBuffers>& buffers,
                    const std::unique_ptr<NvmeParameterSwapper>& swapper,
                    HostSyncCounter& host_syncs)
      : layout_(&layout),
        placement_(&placement),
        buffers_(&buffers),
        swapper_(&swapper),
        host_syncs_(&host_syncs) {}

  at::Tensor operator()(size_t g, size_t b) const {
    const c10::Device device = placement_->device();
    if (NvmeParameterSwapper* swapper = swapper_->get()) {
      if (!device.is_cpu()) {
        host_syncs_->count(HostSync::kPageableCopy);  // a blocking copy per bucket
      }
      // An NVMe bucket's buffer is the collective's own (freed with it); a
      // bucket kept in host memory is copied, as with 'cpu'.
      return swapper->read(g, b).to(device, /*non_blocking=*/false,
                                    /*copy=*/!swapper->on_nvme(g, b));
    }
    const Bucket& bucket = layout_->group(g).buckets()[b];
    at::Tensor shard =
        (*buffers_)[g].param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel);
    if (placement_->parameter_tier() == StateTier::kDevice) {
      return shard;
    }
    // offload_param: the shard goes to the device first, when the gather (or
    // its prefetch) is issued; the collective holds the copy.
    const bool async = placement_->asynchronous_copies(StateTier::kHost, true);
    if (!async && !device.is_cpu()) {
      host_syncs_->count(HostSync::kPageableCopy);  // pin_memory=False
    }
    return shard.to(device, async, /*copy=*/true);
  }

 private:
  const PartitionLayout* layout_;
  const StatePlacement* placement_;
  const std::vector<GroupBuffers>* buffers_;
  const std::unique_ptr<NvmeParameterSwapper>* swapper_;
  HostSyncCounter* host_syncs_;
};

// The gatherer's part in the gradient path: a reduced bucket may release its
// unit, and a backward pass ends at an agreement of every rank.
class GathererGradientEvents final : public GradientReduction::Stage3Events {
 public:
  explicit GathererGradientEvents(ParameterGatherer& gatherer) : gatherer_(gatherer) {}

  void bucket_reduced(size_t group, size_t bucket) override {
    gatherer_.bucket_complete(group, bucket);
  }
  bool wait_for_backward_end(bool outermost) override {
    return gatherer_.wait_for_all_ranks(outermost ? AgreementBarrier::kBackwardEnd
                                                  : AgreementBarrier::kInnerBackwardEnd);
  }
  void backward_finished() override { gatherer_.backward_finished(); }

 private:
  ParameterGatherer& gatherer_;
};

}  // namespace zeroshard
