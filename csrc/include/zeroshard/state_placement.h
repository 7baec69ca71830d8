// Where each piece of a rank's model state lives: the one place that decides
// it, asked by every stage (see docs/design.md, "Offload").
//
// A group's shard is cut into sub-groups of at most sub_group_size elements
// (DeepSpeed's sub_group_size); each sub-group's optimizer state (fp32
// master and moments) lives on one tier. With offload_optimizer the first
// (1 - ratio) of all sub-groups, in group order and rounded down, stay on
// the device and the rest go to the host, or with device 'nvme' to the
// swap file (nvme_state_swapper.h), through host buffers. Stage 3 parameter
// shards live on the host with offload_param 'cpu', in their own swap file
// with 'nvme' (nvme_parameter_swapper.h), on the device otherwise.
//
// Pure bookkeeping plus allocation: knows nothing of optimizers or ranks.
#pragma once

#include "zeroshard/offload_options.h"
#include "zeroshard/partition_layout.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

namespace zeroshard {

enum class StateTier { kDevice, kHost, kNVMe };
const char* state_tier_name(StateTier tier);

// A contiguous range of one group's shard (shard coordinates).
struct SubGroup {
  size_t group = 0;
  int64_t offset = 0;
  int64_t numel = 0;
  StateTier tier = StateTier::kDevice;
};

class StatePlacement {
 public:
  // `shard_numels`: this rank's shard size per group (PartitionLayout's
  // shard_numel, the same on every rank). Groups marked in `one_sub_group`
  // are one sub-group whatever their size (an update rule's: [Note: a rule
  // on the host] in offloaded_optimizer_state.cpp).
  StatePlacement(const std::vector<int64_t>& shard_numels, int64_t sub_group_size,
                 const OffloadOptions& offload_optimizer, const OffloadOptions& offload_param,
                 c10::Device device, const std::vector<bool>& one_sub_group = {});

  // Of `total` sub-groups in group order, how many stay on the device with
  // offload_optimizer.ratio `ratio`: the first (1 - ratio) of them, rounded
  // down. The one formula, also the memory estimator's.
  static int64_t device_sub_group_count(int64_t total, double ratio);

  bool offloads_optimizer() const { return offload_optimizer_.enabled(); }
  const OffloadOptions& offload_optimizer() const { return offload_optimizer_; }
  bool offloads_parameters() const { return offload_param_.enabled(); }
  const std::vector<SubGroup>& sub_groups(size_t group) const { return sub_groups_.at(group); }
  size_t num_groups() const { return sub_groups_.size(); }
  // Largest offloaded (host or NVMe) sub-group, in elements (0 when none):
  // the size of the host staging buffers; and how many there are.
  int64_t largest_host_sub_group() const { return largest_host_; }
  int64_t host_sub_group_count() const { return host_count_; }
  // Whether group `group`'s gradient shard lives in host memory: with every
  // sub-group of the group offloaded nothing on the device reads it, so each
  // reduced bucket slice goes to the host as it is reduced (see [Note:
  // gradients to the host]). A group with sub-groups on the device keeps its
  // shard there.
  bool gradient_shard_on_host(size_t group) const;
  // Where and in what dtype group `group`'s gradient shard is allocated, given
  // `reduced`, the options of its reduced buckets: on the device as reduced;
  // on the host in fp32 with 'cpu' offload, which the host kernel then reads
  // in place; on the host as reduced with 'nvme' offload, where RAM is what
  // binds (a 16-bit shard is half an fp32 one) and the step widens it
  // through staging.
  at::TensorOptions gradient_shard_options(size_t group, const at::TensorOptions& reduced) const;
  // Whether the host kernel reads group `group`'s gradient shard in place
  // (on the host, fp32): 'cpu' offload of every sub-group.
  bool reads_gradient_in_place(size_t group) const {
    return gradient_shard_on_host(group) && offload_tier_ == StateTier::kHost;
  }
  // Whether group `group`'s gradient shard lives in the NVMe gradient swap
  // file instead (offload_optimizer.swap_gradients): not allocated in memory.
  bool swaps_gradients(size_t group) const {
    return offload_optimizer_.swap_gradients() && gradient_shard_on_host(group) &&
           offload_tier_ == StateTier::kNVMe;
  }
  // Whether some offloaded sub-group's gradient is not read in place, so the
  // step needs fp32 staging for gradients.
  bool stages_gradients() const;
  // The tier of offloaded sub-groups: kHost, or kNVMe for device 'nvme'.
  StateTier offload_tier() const { return offload_tier_; }
  StateTier parameter_tier() const {
    if (!offloads_parameters()) {
      return StateTier::kDevice;
    }
    return offload_param_.device() == OffloadDevice::kNVMe ? StateTier::kNVMe : StateTier::kHost;
  }

  c10::Device device() const { return device_; }
  // Host buffers are pinned when copies to the device can be asynchronous.
  bool pinned(StateTier tier, bool for_parameters) const;
  // Where tensors of `tier` are allocated (NVMe states pass through host
  // memory, so kNVMe gives the host's).
  at::TensorOptions options(StateTier tier, c10::ScalarType dtype,
                            bool for_parameters = false) const;
  // Whether copies between `tier` and the device may be non-blocking.
  bool asynchronous_copies(StateTier tier, bool for_parameters) const {
    return pinned(tier, for_parameters);
  }

 private:
  OffloadOptions offload_optimizer_;
  OffloadOptions offload_param_;
  c10::Device device_;
  std::vector<std::vector<SubGroup>> sub_groups_;
  int64_t largest_host_ = 0;
  int64_t host_count_ = 0;
  StateTier offload_tier_ = StateTier::kHost;
};

}  // namespace zeroshard
