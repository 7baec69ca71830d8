// ZeroOptimizer: composition with tensor parallelism. ZeRO shards each rank's
// local pieces over the data-parallel group and never sees the tensor-parallel
// split itself; only two things need the tensor-parallel group: the global
// gradient norm (pieces of a split tensor add up across the group, copies of
// a replicated one count once) and the step's skip decision (a non-finite
// gradient in one piece must skip the step on every piece, or the copies
// drift apart).
#include "zeroshard/zero_optimizer.h"

#include <c10/util/Exception.h>

namespace zeroshard {

void ZeroOptimizer::set_tensor_parallel(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                        std::vector<std::vector<bool>> sharded) {
  TORCH_CHECK_VALUE(group, "set_tensor_parallel needs the tensor-parallel process group");
  TORCH_CHECK_VALUE(sharded.size() == param_groups_.size(), "set_tensor_parallel: expected ",
                    param_groups_.size(), " lists of flags (one per parameter group), got ",
                    sharded.size());
  for (size_t g = 0; g < sharded.size(); ++g) {
    TORCH_CHECK_VALUE(sharded[g].size() == param_groups_[g].params().size(),
                      "set_tensor_parallel: group ", g, " has ", param_groups_[g].params().size(),
                      " parameters but ", sharded[g].size(), " flags");
  }
  tensor_parallel_sharded_ = std::move(sharded);
  tensor_parallel_comm_ =
      group->getSize() > 1 ? std::make_unique<Communicator>(std::move(group)) : nullptr;
}

void ZeroOptimizer::gradient_arrived(size_t group, int64_t index) {
  TORCH_CHECK_INDEX(group < param_groups_.size() && index >= 0 &&
                        index < static_cast<int64_t>(param_groups_[group].params().size()),
                    "gradient_arrived: no parameter ", index, " in group ", group);
  if (!hooks_) {
    return;  // stage 1 reduces from .grad inside step()
  }
  hooks_->track_current_backward();
  on_gradient(group, index, param_groups_[group].params()[index]);
}

at::Tensor ZeroOptimizer::sum_squares_across_tensor_parallel(at::Tensor squares) {
  if (tensor_parallel_comm_) {
    at::Tensor pieces = squares.narrow(0, 0, 1).clone();
    tensor_parallel_comm_->all_reduce_sum(pieces, "tensor_parallel/grad_norm");
    squares.narrow(0, 0, 1).copy_(pieces);
  }
  return squares.sum();
}

void ZeroOptimizer::max_across_tensor_parallel(at::Tensor& tensor, const std::string& tag) {
  if (tensor_parallel_comm_) {
    tensor_parallel_comm_->all_reduce_max(tensor, "tensor_parallel/" + tag);
  }
}

}  // namespace zeroshard
