// The partition layout: the one place that decides where every parameter
// element lives in the flat buffers and which rank owns it. Every stage uses
// it; nothing else computes offsets.
//
// Thread-safety: immutable after construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zeroshard {

// [Note: Partition layout]
// Each parameter group is flattened into one contiguous buffer. Parameters are
// placed in *reverse* registration order, because backward produces gradients
// roughly in that order, so the first bucket to fill is the first in the
// buffer. The buffer is cut into buckets of about `bucket_numel` elements
// (a parameter is never split between buckets; one larger than the bucket size
// gets a bucket of its own). Each bucket is padded to a multiple of the world
// size and rank r owns the r-th contiguous 1/world_size of every bucket.
//
// [Note: aligned slots]
// Every parameter starts on an aligned element (its slot's flat_offset is a
// multiple of the group's `alignment`), and every bucket is padded to a
// multiple of world_size x alignment, so each rank's slice and each bucket
// start aligned too, in the flat buffer, in the shards and in stage 3's
// gathered buffers. The optimizer picks the alignment so that it is
// kAlignmentBytes in the parameters' dtype: cuBLAS(Lt) and vectorised
// kernels fall back to slower paths (or fault) on pointers that are not
// 16-byte aligned, and packed at any element offset, every parameter after
// an odd-sized one was. The gaps are padding: zero in the parameters, the
// gradients and the state, and updated with their runs (an update of zeros
// with a zero gradient stays zero).
//
// [Note: whole parameters]
// A group whose update rule needs each parameter whole (Muon's
// Newton-Schulz on the 2-D update: update_rule.h) is laid out so that no
// parameter straddles a slice: within each bucket, each parameter goes to
// one rank's slice (largest first, to the slice with the fewest elements
// so far), every slice is padded to the largest, and the rank whose slice
// holds a parameter updates all of it. The reduce-scatter then leaves each
// owner its whole parameters' summed gradients and the all-gather hands
// them back, as for any bucket; the cost is the padding that evens the
// slices, on the wire and in the shards.
//
// Which rank gets which of a bucket's slices is free (the padding is the
// same), so the owners are balanced by the rule's work over all buckets
// (UpdateRule::update_cost; Newton-Schulz grows as m * n * min(m, n), not as
// m * n): the slice with the most work goes to the rank with the least so
// far, over the buckets of every group. Without this, the largest slice of every bucket went to
// rank 0 (a stage-3 unit with fewer matrices than ranks, or one matrix per bucket, left the others
// idle while rank 0 orthogonalized every matrix).
//
// A rank's shard is the concatenation of its slices of all buckets, so it is
// one contiguous tensor. When the group fits in one bucket (the default bucket
// size is 5e6 elements) this is exactly "rank r owns one contiguous slice of
// equal length". With several buckets, each bucket's reduce-scatter reads its
// input in place from the flat gradient buffer and writes its output in place
// into the gradient shard, with no staging copy (as Megatron's distributed
// optimizer does). Parameters that straddle a slice boundary are split, so
// every rank holds the same number of elements whatever the tensor sizes.

// The unit of parameters that belong to no gathering unit (stages 1 and 2,
// and stage 3's persistent parameters).
constexpr int64_t kNoUnit = -1;

// See [Note: aligned slots].
constexpr int64_t kAlignmentBytes = 16;
// The alignment, in elements, of a group whose parameters have elements of
// `element_size` bytes.
constexpr int64_t alignment_in_elements(int64_t element_size) {
  return element_size >= kAlignmentBytes ? 1 : kAlignmentBytes / element_size;
}

// Where one parameter sits in its group's flat buffer.
struct ParamSlot {
  int64_t param_index = 0;  // index of the parameter within its group
  int64_t flat_offset = 0;  // first element in the group's flat buffer
  int64_t numel = 0;
  int64_t bucket_index = -1;  // -1 for empty parameters (numel == 0)
  int64_t unit = kNoUnit;     // stage 3: the unit gathered with it
};

// A contiguous range of the flat buffer reduced and gathered as one.
struct Bucket {
  int64_t flat_offset = 0;   // first element in the flat buffer
  int64_t numel = 0;         // padded: a multiple of world_size
  int64_t shard_numel = 0;   // numel / world_size: each rank's slice
  int64_t shard_offset = 0;  // where this bucket's slice starts in a shard
  int64_t first_slot = 0;    // slots [first_slot, end_slot) lie in it
  int64_t end_slot = 0;
  int64_t unit = kNoUnit;  // stage 3: every parameter of a bucket has one unit
};

// The part of one parameter that one rank owns.
struct ShardSegment {
  int64_t param_index = 0;   // index of the parameter within its group
  int64_t param_offset = 0;  // first owned element in the flattened parameter
  int64_t shard_offset = 0;  // where it lives in the rank's shard
  int64_t numel = 0;
  int64_t bucket_index = 0;  // the bucket whose slice holds it
};

// The layout of one parameter group.
class GroupLayout {
 public:
  // param_units (stage 3): the unit of each parameter, or kNoUnit; empty for
  // stages 1 and 2. A bucket then holds one unit, never split by size.
  // alignment: every slot starts at a multiple of it (elements; see [Note:
  // aligned slots]). whole_parameters: [Note: whole parameters];
  // param_costs: each parameter's update work, which balances its owners
  // there (empty: its elements); prior_rank_costs: the work each rank owns
  // in the groups laid out before this one (empty: none).
  GroupLayout(const std::vector<int64_t>& param_numels, int64_t world_size, int64_t bucket_numel,
              const std::vector<int64_t>& param_units = {}, int64_t alignment = 1,
              bool whole_parameters = false, const std::vector<double>& param_costs = {},
              const std::vector<double>& prior_rank_costs = {});

  int64_t world_size() const { return world_size_; }
  int64_t alignment() const { return alignment_; }
  bool whole_parameters() const { return whole_parameters_; }
  // The whole-parameter work each rank owns, this group's included.
  const std::vector<double>& rank_costs() const { return rank_costs_; }
  int64_t num_params() const { return static_cast<int64_t>(slot_of_param_.size()); }
  // Padded length of the flat buffer: a multiple of world_size.
  int64_t flat_numel() const { return flat_numel_; }
  // Elements each rank owns: flat_numel() / world_size().
  int64_t shard_numel() const { return flat_numel_ / world_size_; }
  // Real (unpadded) elements of the group.
  int64_t param_numel() const { return param_numel_; }

  // Slots in flat-buffer order.
  const std::vector<ParamSlot>& slots() const { return slots_; }
  const ParamSlot& slot_of_param(int64_t param_index) const;
  const std::vector<Bucket>& buckets() const { return buckets_; }

  // Flat-buffer offset of `rank`'s slice of `bucket`.
  int64_t rank_slice_offset(const Bucket& bucket, int64_t rank) const {
    return bucket.flat_offset + rank * bucket.shard_numel;
  }

  // The segments `rank` owns, in shard order. A parameter contributes at most
  // one segment per rank (it lies inside one bucket).
  std::vector<ShardSegment> segments_of_rank(int64_t rank) const;

  // Feeds everything that defines the layout into a running hash.
  uint64_t fingerprint(uint64_t seed) const;

 private:
  // Places the slots [first, end) of `bucket` (starting at its flat_offset)
  // and sets its sizes: [Note: whole parameters]; adds the work each rank
  // gets to rank_costs_.
  void place_whole_parameters(Bucket& bucket, int64_t end, const std::vector<double>& costs);

  int64_t world_size_;
  int64_t bucket_numel_;
  int64_t alignment_;
  bool whole_parameters_;
  std::vector<double> rank_costs_;
  int64_t flat_numel_ = 0;
  int64_t param_numel_ = 0;
  std::vector<ParamSlot> slots_;
  std::vector<int64_t> slot_of_param_;
  std::vector<Bucket> buckets_;
};

// The layout of all parameter groups of one optimizer.
class PartitionLayout {
 public:
  // group_alignments: one per group (elements), or empty for 1 everywhere.
  // group_whole_parameters: one per group ([Note: whole parameters]), or
  // empty for none; group_param_costs: one per group (GroupLayout's
  // param_costs), or empty.
  PartitionLayout(const std::vector<std::vector<int64_t>>& group_param_numels, int64_t world_size,
                  int64_t bucket_numel,
                  const std::vector<std::vector<int64_t>>& group_param_units = {},
                  const std::vector<int64_t>& group_alignments = {},
                  const std::vector<bool>& group_whole_parameters = {},
                  const std::vector<std::vector<double>>& group_param_costs = {});

  int64_t world_size() const { return world_size_; }
  const std::vector<GroupLayout>& groups() const { return groups_; }
  const GroupLayout& group(size_t index) const { return groups_.at(index); }

  // Identical on every rank that built the same layout; compared across ranks
  // at construction and stored in checkpoints.
  int64_t fingerprint() const;

 private:
  int64_t world_size_;
  std::vector<GroupLayout> groups_;
};

}  // namespace zeroshard
