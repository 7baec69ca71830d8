// ZeroOptimizer: composition with tensor parallelism. ZeRO shards each rank's
// local pieces over the data-parallel group and never sees the tensor-parallel
// split itself; only two things need the tensor-parallel group: the global
// gradient norm (pieces of a split tensor add up across the group, copies of
// a replicated one count once) and the step's skip decision (a non-finite
// gradient in one piece must skip the step on every piece, or the copies
// drift apart); both are in zero_optimizer_clipping.cpp. Here: setting the
// group, and where each piece sits in its unsplit tensor for checkpoints.
#include "zero_optimizer_impl.h"

#include "../checkpoint/checkpoint_detail.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

namespace zeroshard {

void ZeroOptimizer::Impl::set_model_parallel(ModelParallel kind,
                                             c10::intrusive_ptr<c10d::ProcessGroup> group,
                                             std::vector<std::vector<bool>> sharded,
                                             std::vector<std::vector<TensorParallelSplit>> splits) {
  TORCH_CHECK_VALUE(group, "set_tensor_parallel needs the tensor-parallel process group");
  TORCH_CHECK_VALUE(sharded.size() == param_groups_.size(), "set_tensor_parallel: expected ",
                    param_groups_.size(), " lists of flags (one per parameter group), got ",
                    sharded.size());
  for (size_t g = 0; g < sharded.size(); ++g) {
    TORCH_CHECK_VALUE(sharded[g].size() == param_groups_[g].params().size(),
                      "set_tensor_parallel: group ", g, " has ", param_groups_[g].params().size(),
                      " parameters but ", sharded[g].size(), " flags");
  }
  TORCH_CHECK_VALUE(splits.empty() || splits.size() == sharded.size(),
                    "set_tensor_parallel: expected no splits or one list per parameter group (",
                    sharded.size(), "), got ", splits.size());
  for (size_t g = 0; g < splits.size(); ++g) {
    TORCH_CHECK_VALUE(splits[g].size() == sharded[g].size(), "set_tensor_parallel: group ", g,
                      " has ", sharded[g].size(), " parameters but ", splits[g].size(), " splits");
    for (size_t i = 0; i < splits[g].size(); ++i) {
      const TensorParallelSplit& split = splits[g][i];
      const at::IntArrayRef local = param_groups_[g].params()[i].sizes();
      const auto dims = static_cast<int64_t>(local.size());
      // dim -1 with sharded set: a tensor of this rank's own (an expert).
      bool fits = split.full_shape.size() == local.size() && split.dim < dims &&
                  (split.dim < 0 || sharded[g][i]);
      for (int64_t d = 0; fits && d < dims; ++d) {
        fits = d == split.dim ? split.start >= 0 && split.start + local[d] <= split.full_shape[d]
                              : split.full_shape[d] == local[d];
      }
      TORCH_CHECK_VALUE(fits, "set_tensor_parallel: parameter ", i, " of group ", g, " has shape ",
                        local, " but its split says dim ", split.dim, ", start ", split.start,
                        ", unsplit shape ", at::IntArrayRef(split.full_shape),
                        " (expected: dim -1 and the same shape for a whole tensor; for a piece, "
                        "sharded, the unsplit shape equal but along dim, and start + size <= "
                        "unsplit size)");
      // A whole-parameter rule (Muon, Adafactor) would update a piece as if it
      // were the matrix ([Note: whole parameters]).
      const auto* rule = dynamic_cast<const RuleOptions*>(&param_groups_[g].options());
      TORCH_CHECK_VALUE(split.dim < 0 || rule == nullptr ||
                            !rule->rule()->whole_parameters(rule->hyperparameters()),
                        "set_tensor_parallel: parameter ", i, " of group ", g,
                        " is a piece split along dim ", split.dim, ", and update rule '",
                        rule ? rule->rule()->name() : std::string(),
                        "' updates whole matrices: it would update the piece as a matrix of its "
                        "own; not supported yet");
    }
  }
  tensor_parallel_sharded_ = std::move(sharded);
  tensor_parallel_splits_ = std::move(splits);
  groups_->set_model_parallel(kind,
                              group->getSize() > 1 ? make_communicator(std::move(group)) : nullptr);
}

void ZeroOptimizer::Impl::set_expert_parallel(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  TORCH_CHECK_VALUE(group, "set_expert_parallel needs the expert-parallel process group");
  // Each rank's experts are tensors of their own: for the norm, the skip
  // decision and checkpoints they are what a tensor-parallel piece with no
  // split dimension is (split dim -1, the whole shape).
  std::vector<std::vector<bool>> sharded;
  std::vector<std::vector<TensorParallelSplit>> splits;
  for (const auto& param_group : param_groups_) {
    sharded.emplace_back(param_group.params().size(), true);
    splits.emplace_back();
    for (const at::Tensor& param : param_group.params()) {
      splits.back().push_back({-1, 0, param.sizes().vec()});
    }
  }
  set_model_parallel(ModelParallel::kExpert, std::move(group), std::move(sharded),
                     std::move(splits));
}

// ---- Checkpoints: every state is stored in its unsplit tensor's element
// order, each piece written once (a copy by tensor-parallel rank 0), and the
// files of every tensor-parallel rank go into one directory under one index.

TensorParallelSplit ZeroOptimizer::Impl::tensor_parallel_split(size_t g, size_t i) const {
  if (!tensor_parallel_splits_.empty()) {
    return tensor_parallel_splits_[g][i];
  }
  const bool sharded = !tensor_parallel_sharded_.empty() && tensor_parallel_sharded_[g][i];
  TORCH_CHECK_VALUE(!sharded, "checkpoint of tensor-parallel parameter '", parameter_name(g, i),
                    "': set_tensor_parallel was given no splits, so where its piece sits in the "
                    "unsplit tensor is unknown; pass them (the Python layer does)");
  return {-1, 0, param_groups_[g].params()[i].sizes().vec()};
}

bool ZeroOptimizer::Impl::writes_checkpoint_piece(size_t g, size_t i) const {
  return !groups_->model_parallel() || groups_->model_parallel()->rank() == 0 ||
         (!tensor_parallel_sharded_.empty() && tensor_parallel_sharded_[g][i]);
}

void ZeroOptimizer::Impl::agree_on_checkpoint_errors(const std::string& local_error,
                                                     const std::string& what) {
  const std::string error =
      groups_->agree(local_error, "checkpoint_errors", groups_->writers_scope());
  TORCH_CHECK_VALUE(error.empty(), "could not ", what, " ", error);
}

}  // namespace zeroshard
