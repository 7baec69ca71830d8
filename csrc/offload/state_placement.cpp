#include "zeroshard/state_placement.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace zeroshard {

const char* state_tier_name(StateTier tier) {
  switch (tier) {
    case StateTier::kDevice:
      return "device";
    case StateTier::kHost:
      return "host";
    case StateTier::kNVMe:
      return "nvme";
  }
  return "unknown";
}

StatePlacement::StatePlacement(const std::vector<int64_t>& shard_numels, int64_t sub_group_size,
                               const OffloadOptions& offload_optimizer,
                               const OffloadOptions& offload_param, c10::Device device,
                               const std::vector<bool>& one_sub_group)
    : offload_optimizer_(offload_optimizer), offload_param_(offload_param), device_(device) {
  TORCH_CHECK_VALUE(sub_group_size > 0, "sub_group_size must be > 0 elements, got ",
                    sub_group_size);
  int64_t total = 0;
  sub_groups_.resize(shard_numels.size());
  for (size_t g = 0; g < shard_numels.size(); ++g) {
    const int64_t size = g < one_sub_group.size() && one_sub_group[g]
                             ? std::max<int64_t>(shard_numels[g], 1)
                             : sub_group_size;
    for (int64_t offset = 0; offset < shard_numels[g]; offset += size) {
      sub_groups_[g].push_back(
          SubGroup{g, offset, std::min(size, shard_numels[g] - offset), StateTier::kDevice});
      ++total;
    }
  }
  if (!offload_optimizer_.enabled()) {
    return;
  }
  offload_tier_ =
      offload_optimizer_.device() == OffloadDevice::kNVMe ? StateTier::kNVMe : StateTier::kHost;
  const int64_t on_device = device_sub_group_count(total, offload_optimizer_.ratio());
  int64_t index = 0;
  for (auto& group : sub_groups_) {
    for (auto& sub_group : group) {
      if (index++ >= on_device) {
        sub_group.tier = offload_tier_;
        largest_host_ = std::max(largest_host_, sub_group.numel);
        ++host_count_;
      }
    }
  }
}

int64_t StatePlacement::device_sub_group_count(int64_t total, double ratio) {
  return static_cast<int64_t>(std::floor((1.0 - ratio) * static_cast<double>(total) + 1e-9));
}

bool StatePlacement::gradient_shard_on_host(size_t group) const {
  const std::vector<SubGroup>& subs = sub_groups_.at(group);
  return offloads_optimizer() && !subs.empty() &&
         std::all_of(subs.begin(), subs.end(),
                     [](const SubGroup& s) { return s.tier != StateTier::kDevice; });
}

bool StatePlacement::stages_gradients() const {
  for (size_t g = 0; g < sub_groups_.size(); ++g) {
    const std::vector<SubGroup>& subs = sub_groups_[g];
    const bool offloaded = std::any_of(
        subs.begin(), subs.end(), [](const SubGroup& s) { return s.tier != StateTier::kDevice; });
    if (offloaded && !reads_gradient_in_place(g)) {
      return true;
    }
  }
  return false;
}

at::TensorOptions StatePlacement::gradient_shard_options(size_t group,
                                                         const at::TensorOptions& reduced) const {
  if (!gradient_shard_on_host(group)) {
    return reduced;
  }
  return options(StateTier::kHost, reads_gradient_in_place(group)
                                       ? at::kFloat
                                       : c10::typeMetaToScalarType(reduced.dtype()));
}

bool StatePlacement::pinned(StateTier tier, bool for_parameters) const {
  const OffloadOptions& offload = for_parameters ? offload_param_ : offload_optimizer_;
  return tier != StateTier::kDevice && offload.pin_memory() && device_.is_cuda();
}

at::TensorOptions StatePlacement::options(StateTier tier, c10::ScalarType dtype,
                                          bool for_parameters) const {
  if (tier == StateTier::kDevice) {
    return at::TensorOptions().dtype(dtype).device(device_);
  }
  return at::TensorOptions().dtype(dtype).device(c10::kCPU).pinned_memory(
      pinned(tier, for_parameters));
}

}  // namespace zeroshard
