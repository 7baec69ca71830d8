// One checkpoint read into this rank's shards: its index, the saved parameter
// each of this rank's parameters is (by name or alias, shapes compared
// unsplit), and the saved pieces of a state read, verified (CRC-32C) and
// handed over range by range at this rank's shard offsets, for a checkpoint
// saved at any world size, layout or tensor-parallel degree. Knows the
// checkpoint format; knows nothing of the optimizer. Internal.
#pragma once

#include "zeroshard/optimizer_states.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/safetensors.h"
#include "zeroshard/tensor_parallel_split.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

class CheckpointReader {
 public:
  // What the reader needs of one of this rank's parameters.
  struct Parameter {
    std::string name;                  // its checkpoint name
    TensorParallelSplit split;         // where its piece sits in the unsplit tensor
    std::vector<int64_t> local_shape;  // its shape on this rank
  };

  // Reads and checks `path`'s index.json.
  explicit CheckpointReader(std::string path);
  CheckpointReader(const CheckpointReader&) = delete;  // match() points into the index
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& path() const { return path_; }
  const nlohmann::json& index() const { return index_; }
  // The index itself, without a copy (it can hold every parameter's pieces):
  // the reader is done after it.
  nlohmann::json release_index() && { return std::move(index_); }

  // Finds each parameter (per group) among the saved ones; throws "checkpoint
  // ... is of another model", naming the first differences, where one is
  // missing or has another shape, or (unless other ranks may hold them: tensor
  // or expert parallelism, checked by the caller over every rank) a saved one
  // is held by none of them.
  void match(std::vector<std::vector<Parameter>> groups, bool others_may_hold);
  // The index entry parameter `index` of group g matched (after match()).
  const nlohmann::json& saved_entry(size_t group, int64_t index) const {
    return *match_.at(group).at(static_cast<size_t>(index));
  }
  // The saved names this rank's parameters matched (not their aliases).
  const std::vector<std::string>& held() const { return held_; }
  // The steps the matched parameters had taken, per group.
  std::vector<int64_t> saved_steps(size_t group) const;
  // Whether every group's parameters were saved in the group of the same
  // index (with other ranks' parameters there too when `others_may_hold`):
  // then the saved hyper-parameters apply to this optimizer's groups.
  bool same_grouping(bool others_may_hold) const;

  // A whole file the index records (a replicated or rank file), its size and
  // CRC-32C checked against the record.
  std::string read_verified_file(const std::string& name, const nlohmann::json& record) const;

  // Hands each range of `state` that this rank's `segments` of group g hold
  // to put(shard offset, values, length), read and verified one saved piece
  // at a time; a segment whose parameter was never stepped has no state
  // (zero, as a fresh one): zero(shard offset, length). Returns whether any
  // segment had the state.
  using Put = std::function<void(int64_t, const float*, int64_t)>;
  using Zero = std::function<void(int64_t, int64_t)>;
  bool visit_state(size_t group, const std::vector<ShardSegment>& segments,
                   OptimizerStateName state, const Put& put, const Zero& zero);

 private:
  const SafetensorsReader& file(size_t f);

  std::string path_;
  nlohmann::json index_;
  std::vector<std::vector<Parameter>> params_;
  std::vector<std::vector<const nlohmann::json*>> match_;  // entries of index_["params"]
  std::vector<std::string> held_;
  std::vector<std::optional<SafetensorsReader>> files_;  // opened on first use
};

}  // namespace zeroshard
