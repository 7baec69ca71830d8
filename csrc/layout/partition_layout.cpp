#include "zeroshard/partition_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard {
namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// FNV-1a over 64-bit words: stable across processes and builds, unlike
// std::hash.
uint64_t mix(uint64_t hash, int64_t value) {
  auto word = static_cast<uint64_t>(value);
  for (int byte = 0; byte < 8; ++byte) {
    hash ^= (word >> (8 * byte)) & 0xffu;
    hash *= 1099511628211ull;
  }
  return hash;
}

}  // namespace

GroupLayout::GroupLayout(const std::vector<int64_t>& param_numels, int64_t world_size,
                         int64_t bucket_numel, const std::vector<int64_t>& param_units,
                         int64_t alignment, bool whole_parameters,
                         const std::vector<double>& param_costs,
                         const std::vector<double>& prior_rank_costs)
    : world_size_(world_size),
      bucket_numel_(bucket_numel),
      alignment_(alignment),
      whole_parameters_(whole_parameters) {
  TORCH_CHECK_VALUE(world_size >= 1, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK_VALUE(bucket_numel >= 1, "bucket size must be >= 1 element, got ", bucket_numel);
  TORCH_CHECK_VALUE(alignment >= 1, "alignment must be >= 1 element, got ", alignment);
  const auto num_params = static_cast<int64_t>(param_numels.size());
  TORCH_CHECK_VALUE(param_units.empty() || param_units.size() == param_numels.size(),
                    "param_units must be empty or give one unit per parameter");
  TORCH_CHECK_VALUE(param_costs.empty() || param_costs.size() == param_numels.size(),
                    "param_costs must be empty or give one cost per parameter");
  std::vector<double> costs = param_costs;
  if (costs.empty()) {
    costs.assign(param_numels.begin(), param_numels.end());
  }
  TORCH_CHECK_VALUE(
      prior_rank_costs.empty() || static_cast<int64_t>(prior_rank_costs.size()) == world_size,
      "prior_rank_costs must be empty or give one cost per rank");
  rank_costs_ = prior_rank_costs;
  rank_costs_.resize(world_size_, 0.0);
  slot_of_param_.assign(num_params, -1);
  const bool has_units = !param_units.empty();
  auto unit_of = [&](int64_t index) { return has_units ? param_units[index] : kNoUnit; };

  // See [Note: Partition layout]: reverse registration order; with units, each
  // unit's parameters are made contiguous (units in order of first appearance,
  // parameters of no unit last), so a unit is gathered by one collective.
  std::vector<int64_t> order;
  for (int64_t index = num_params - 1; index >= 0; --index) {
    order.push_back(index);
  }
  if (has_units) {
    std::vector<std::pair<int64_t, int64_t>> first_seen;  // unit -> rank of first appearance
    auto rank_of = [&](int64_t unit) {
      if (unit == kNoUnit) {
        return num_params;  // after every unit
      }
      for (const auto& [u, r] : first_seen) {
        if (u == unit) {
          return r;
        }
      }
      first_seen.emplace_back(unit, static_cast<int64_t>(first_seen.size()));
      return first_seen.back().second;
    };
    std::vector<int64_t> key(num_params);
    for (int64_t index : order) {
      key[index] = rank_of(unit_of(index));
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return key[a] < key[b]; });
  }

  // [Note: whole parameters]: a bucket of whole parameters holds room for
  // world_size of the largest, so that every rank can own one; cut at the
  // bucket size alone, a large matrix would sit alone in its bucket, its
  // owner's slice padded on every other rank: the group unsharded, world
  // size times over in the flat buffers and on the wire.
  int64_t capacity = bucket_numel_;
  if (whole_parameters_) {
    const int64_t largest =
        param_numels.empty() ? 0 : *std::max_element(param_numels.begin(), param_numels.end());
    capacity = std::max(capacity, world_size_ * round_up(largest, alignment_));
  }

  // See [Note: Partition layout]: reverse registration order; [Note: aligned
  // slots]: each slot at an aligned offset, each bucket a multiple of
  // world_size x alignment.
  int64_t offset = 0;
  Bucket open;
  open.first_slot = 0;
  int64_t open_end = 0;  // the open bucket's used length, padding between slots included
  auto close_bucket = [&]() {
    if (open_end == 0) {
      return;
    }
    open.end_slot = static_cast<int64_t>(slots_.size());
    if (whole_parameters_) {
      place_whole_parameters(open, open.end_slot, costs);
    } else {
      open.numel = round_up(open_end, world_size_ * alignment_);
      open.shard_numel = open.numel / world_size_;
    }
    offset = open.flat_offset + open.numel;
    buckets_.push_back(open);
    open = Bucket();
    open.flat_offset = offset;
    open.first_slot = static_cast<int64_t>(slots_.size());
    open.shard_offset = buckets_.back().shard_offset + buckets_.back().shard_numel;
    open_end = 0;
  };
  for (int64_t index : order) {
    const int64_t numel = param_numels[index];
    TORCH_CHECK_VALUE(numel >= 0, "parameter numel must be >= 0, got ", numel);
    ParamSlot slot;
    slot.param_index = index;
    slot.numel = numel;
    slot.unit = unit_of(index);
    if (numel > 0) {
      // A unit is never split (it is gathered as one); parameters of no unit
      // are cut into buckets by size as usual.
      const bool unit_changes = open_end > 0 && slot.unit != open.unit;
      const bool too_big =
          open_end > 0 && slot.unit == kNoUnit && round_up(open_end, alignment_) + numel > capacity;
      if (unit_changes || too_big) {
        close_bucket();
      }
      open.unit = slot.unit;
      const int64_t position = round_up(open_end, alignment_);
      slot.flat_offset = open.flat_offset + position;
      slot.bucket_index = static_cast<int64_t>(buckets_.size());
      open_end = position + numel;
      param_numel_ += numel;
    } else {
      slot.flat_offset = open.flat_offset + open_end;
    }
    slot_of_param_[index] = static_cast<int64_t>(slots_.size());
    slots_.push_back(slot);
  }
  close_bucket();
  flat_numel_ = buckets_.empty() ? 0 : buckets_.back().flat_offset + buckets_.back().numel;
  // Empty slots after the last real one still need end_slot coverage for
  // nothing; they belong to no bucket.
  int64_t shard_total = 0;
  for (const auto& bucket : buckets_) {
    shard_total += bucket.shard_numel;
  }
  TORCH_INTERNAL_ASSERT(shard_total * world_size_ == flat_numel_,
                        "shard sizes must sum to the padded flat size");
}

void GroupLayout::place_whole_parameters(Bucket& bucket, int64_t end,
                                         const std::vector<double>& costs) {
  // Largest first, each to the slice with the fewest elements so far (ties
  // to the lowest): the LPT rule, so the slices come out even and the
  // padding that evens them stays small.
  std::vector<int64_t> by_size;
  for (int64_t s = bucket.first_slot; s < end; ++s) {
    by_size.push_back(s);
  }
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](int64_t a, int64_t b) { return slots_[a].numel > slots_[b].numel; });
  std::vector<int64_t> filled(world_size_, 0);  // aligned elements of each slice
  std::vector<double> slice_costs(world_size_, 0.0);
  std::vector<int64_t> slice(slots_.size(), 0);
  std::vector<int64_t> position(slots_.size(), 0);
  for (int64_t s : by_size) {
    const auto k = std::min_element(filled.begin(), filled.end()) - filled.begin();
    slice[s] = k;
    position[s] = filled[k];
    filled[k] += round_up(slots_[s].numel, alignment_);
    slice_costs[k] += costs[slots_[s].param_index];
  }
  // Then the slices to ranks: the most work to the rank with the least so
  // far (ties to the lowest rank), [Note: whole parameters].
  std::vector<int64_t> slices_by_cost(world_size_);
  std::vector<int64_t> ranks_by_cost(world_size_);
  for (int64_t k = 0; k < world_size_; ++k) {
    slices_by_cost[k] = k;
    ranks_by_cost[k] = k;
  }
  std::stable_sort(slices_by_cost.begin(), slices_by_cost.end(),
                   [&](int64_t a, int64_t b) { return slice_costs[a] > slice_costs[b]; });
  std::stable_sort(ranks_by_cost.begin(), ranks_by_cost.end(),
                   [&](int64_t a, int64_t b) { return rank_costs_[a] < rank_costs_[b]; });
  std::vector<int64_t> owner_of_slice(world_size_);
  for (int64_t i = 0; i < world_size_; ++i) {
    owner_of_slice[slices_by_cost[i]] = ranks_by_cost[i];
    rank_costs_[ranks_by_cost[i]] += slice_costs[slices_by_cost[i]];
  }
  std::vector<int64_t> owner(slots_.size(), 0);
  for (int64_t s : by_size) {
    owner[s] = owner_of_slice[slice[s]];
  }
  bucket.shard_numel =
      std::max<int64_t>(alignment_, *std::max_element(filled.begin(), filled.end()));
  bucket.numel = bucket.shard_numel * world_size_;
  for (int64_t s = bucket.first_slot; s < end; ++s) {
    ParamSlot& slot = slots_[s];
    slot.flat_offset = slot.numel == 0
                           ? bucket.flat_offset
                           : bucket.flat_offset + owner[s] * bucket.shard_numel + position[s];
  }
  // Slots stay in flat-buffer order.
  std::stable_sort(
      slots_.begin() + bucket.first_slot, slots_.begin() + end,
      [](const ParamSlot& a, const ParamSlot& b) { return a.flat_offset < b.flat_offset; });
  for (int64_t s = bucket.first_slot; s < end; ++s) {
    slot_of_param_[slots_[s].param_index] = s;
  }
}

const ParamSlot& GroupLayout::slot_of_param(int64_t param_index) const {
  TORCH_CHECK_INDEX(param_index >= 0 && param_index < num_params(), "parameter index ", param_index,
                    " out of range [0, ", num_params(), ")");
  return slots_[slot_of_param_[param_index]];
}

std::vector<ShardSegment> GroupLayout::segments_of_rank(int64_t rank) const {
  TORCH_CHECK_INDEX(rank >= 0 && rank < world_size_, "rank ", rank, " out of range for world size ",
                    world_size_);
  std::vector<ShardSegment> segments;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    const int64_t begin = rank_slice_offset(bucket, rank);
    const int64_t end = begin + bucket.shard_numel;
    for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
      const ParamSlot& slot = slots_[s];
      const int64_t lo = std::max(begin, slot.flat_offset);
      const int64_t hi = std::min(end, slot.flat_offset + slot.numel);
      if (lo >= hi) {
        continue;
      }
      ShardSegment segment;
      segment.param_index = slot.param_index;
      segment.param_offset = lo - slot.flat_offset;
      segment.shard_offset = bucket.shard_offset + (lo - begin);
      segment.numel = hi - lo;
      segment.bucket_index = static_cast<int64_t>(b);
      segments.push_back(segment);
    }
  }
  return segments;
}

uint64_t GroupLayout::fingerprint(uint64_t seed) const {
  uint64_t hash = mix(seed, world_size_);
  hash = mix(hash, bucket_numel_);
  if (alignment_ != 1) {  // unaligned layouts keep the fingerprints they had
    hash = mix(hash, alignment_);
  }
  if (whole_parameters_) {
    hash = mix(hash, 0x77686f6c65);  // "whole"
    // Costs move parameters between ranks at the same sizes.
    for (const auto& slot : slots_) {
      hash = mix(hash, slot.flat_offset);
    }
  }
  for (const auto& slot : slots_) {
    hash = mix(hash, slot.param_index);
    hash = mix(hash, slot.numel);
    if (slot.unit != kNoUnit) {  // stage 1/2 fingerprints stay what they were
      hash = mix(hash, slot.unit);
    }
  }
  return hash;
}

PartitionLayout::PartitionLayout(const std::vector<std::vector<int64_t>>& group_param_numels,
                                 int64_t world_size, int64_t bucket_numel,
                                 const std::vector<std::vector<int64_t>>& group_param_units,
                                 const std::vector<int64_t>& group_alignments,
                                 const std::vector<bool>& group_whole_parameters,
                                 const std::vector<std::vector<double>>& group_param_costs)
    : world_size_(world_size) {
  TORCH_CHECK_VALUE(
      group_param_units.empty() || group_param_units.size() == group_param_numels.size(),
      "group_param_units must be empty or give one entry per group");
  TORCH_CHECK_VALUE(
      group_alignments.empty() || group_alignments.size() == group_param_numels.size(),
      "group_alignments must be empty or give one entry per group");
  TORCH_CHECK_VALUE(
      group_whole_parameters.empty() || group_whole_parameters.size() == group_param_numels.size(),
      "group_whole_parameters must be empty or give one entry per group");
  TORCH_CHECK_VALUE(
      group_param_costs.empty() || group_param_costs.size() == group_param_numels.size(),
      "group_param_costs must be empty or give one entry per group");
  groups_.reserve(group_param_numels.size());
  for (size_t g = 0; g < group_param_numels.size(); ++g) {
    // A copy: the reference would point into groups_ while it grows.
    const std::vector<double> prior =
        groups_.empty() ? std::vector<double>{} : groups_.back().rank_costs();
    groups_.emplace_back(group_param_numels[g], world_size, bucket_numel,
                         group_param_units.empty() ? std::vector<int64_t>{} : group_param_units[g],
                         group_alignments.empty() ? 1 : group_alignments[g],
                         !group_whole_parameters.empty() && group_whole_parameters[g],
                         group_param_costs.empty() ? std::vector<double>{} : group_param_costs[g],
                         prior);
  }
}

int64_t PartitionLayout::fingerprint() const {
  uint64_t hash = 1469598103934665603ull;
  hash = mix(hash, static_cast<int64_t>(groups_.size()));
  for (const auto& group : groups_) {
    hash = group.fingerprint(hash);
  }
  // Keep it positive so it survives a round trip through an int64 tensor and
  // prints readably.
  return static_cast<int64_t>(hash >> 1);
}

}  // namespace zeroshard
