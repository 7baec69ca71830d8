#include "zeroshard/communicator.h"

#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <chrono>

namespace zeroshard {
namespace {

int64_t bytes_of(const at::Tensor& tensor) {
  return tensor.numel() * static_cast<int64_t>(tensor.element_size());
}

}  // namespace

const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kNone:
      return "none";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kBroadcast:
      return "broadcast";
  }
  return "unknown";
}

void PendingCollective::wait() {
  if (!work_) {
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  work_->wait();
  work_.reset();
  if (stats_ != nullptr) {
    stats_->wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (log_ != nullptr) {
    log_->push_back(CommEvent{"wait", kind_, bytes_, tag_});
  }
}

Communicator::Communicator(c10::intrusive_ptr<c10d::ProcessGroup> process_group)
    : process_group_(std::move(process_group)) {
  TORCH_CHECK_VALUE(process_group_, "zeroshard needs a process group; got a null one");
  rank_ = process_group_->getRank();
  world_size_ = process_group_->getSize();
}

PendingCollective Communicator::track(c10::intrusive_ptr<c10d::Work> work, CollectiveKind kind,
                                      int64_t bytes, const std::string& tag) {
  stats_.calls += 1;
  switch (kind) {
    case CollectiveKind::kNone:
      break;
    case CollectiveKind::kAllReduce:
      stats_.all_reduce_bytes += bytes;
      break;
    case CollectiveKind::kReduceScatter:
      stats_.reduce_scatter_bytes += bytes;
      break;
    case CollectiveKind::kAllGather:
      stats_.all_gather_bytes += bytes;
      break;
    case CollectiveKind::kBroadcast:
      stats_.broadcast_bytes += bytes;
      break;
  }
  if (log_enabled_) {
    log_.push_back(CommEvent{"launch", kind, bytes, tag});
  }
  return PendingCollective(std::move(work), kind, bytes, tag, log_enabled_ ? &log_ : nullptr,
                           &stats_);
}

void Communicator::check_order(CollectiveKind kind, const at::Tensor& tensor,
                               const std::string& tag) {
  if (!order_check_ || world_size_ == 1) {
    return;
  }
  const std::string description = std::string(collective_kind_name(kind)) + " '" + tag + "' of " +
                                  std::to_string(tensor.numel()) + " elements";
  // FNV-1a of the description, kept positive so that max(-x) gives the minimum.
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : description) {
    hash = (hash ^ c) * 1099511628211ull;
  }
  const auto signature = static_cast<int64_t>(hash >> 1);
  checked_.emplace(signature, description);
  std::vector<at::Tensor> tensors{
      at::tensor({signature, -signature}, at::kLong).to(tensor.device())};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  try {
    track(process_group_->allreduce(tensors, options), CollectiveKind::kAllReduce, 16,
          "order_check")
        .wait();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "rank ", rank_, " timed out or failed at step ", step_, " before issuing ",
                description,
                ": another rank did not issue a matching collective (did the ranks run "
                "different modules or a different number of steps?). Cause: ",
                e.what_without_backtrace());
  }
  const at::Tensor extremes = tensors[0].cpu();
  const int64_t largest = extremes[0].item<int64_t>();
  const int64_t smallest = -extremes[1].item<int64_t>();
  if (largest == signature && smallest == signature) {
    return;
  }
  const int64_t other = largest != signature ? largest : smallest;
  const auto known = checked_.find(other);
  TORCH_CHECK(false, "the ranks' collectives diverged at step ", step_, ": rank ", rank_,
              " is about to issue ", description, " but another rank issued ",
              known != checked_.end() ? known->second : std::string("a different collective"),
              ". Every rank must run the same modules in the same order (stage 3 gathers "
              "parameters from module hooks); data-dependent control flow must agree across "
              "ranks");
}

void Communicator::all_reduce(at::Tensor& tensor, c10d::ReduceOp::RedOpType op,
                              const std::string& tag) {
  check_order(CollectiveKind::kAllReduce, tensor, tag);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  track(process_group_->allreduce(tensors, options), CollectiveKind::kAllReduce, bytes_of(tensor),
        tag)
      .wait();
}

void Communicator::all_reduce_sum(at::Tensor& tensor, const std::string& tag) {
  all_reduce(tensor, c10d::ReduceOp::SUM, tag);
}

void Communicator::all_reduce_max(at::Tensor& tensor, const std::string& tag) {
  all_reduce(tensor, c10d::ReduceOp::MAX, tag);
}

PendingCollective Communicator::reduce_scatter_sum(at::Tensor& output, at::Tensor& input,
                                                   const std::string& tag) {
  TORCH_INTERNAL_ASSERT(input.numel() == output.numel() * world_size_,
                        "reduce_scatter: input must be world_size times the output");
  if (world_size_ == 1) {
    output.copy_(input);
    return PendingCollective();
  }
  check_order(CollectiveKind::kReduceScatter, input, tag);
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return track(process_group_->_reduce_scatter_base(output, input, options),
               CollectiveKind::kReduceScatter, bytes_of(input), tag);
}

PendingCollective Communicator::all_gather(at::Tensor& output, at::Tensor& input,
                                           const std::string& tag) {
  TORCH_INTERNAL_ASSERT(output.numel() == input.numel() * world_size_,
                        "all_gather: output must be world_size times the input");
  if (world_size_ == 1) {
    output.copy_(input);
    return PendingCollective();
  }
  check_order(CollectiveKind::kAllGather, output, tag);
  return track(process_group_->_allgather_base(output, input), CollectiveKind::kAllGather,
               bytes_of(output), tag);
}

void Communicator::broadcast(at::Tensor& tensor, int64_t root, const std::string& tag) {
  if (world_size_ == 1) {
    return;
  }
  check_order(CollectiveKind::kBroadcast, tensor, tag);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  track(process_group_->broadcast(tensors, options), CollectiveKind::kBroadcast, bytes_of(tensor),
        tag)
      .wait();
}

void Communicator::raise_if_any_rank_failed(const std::string& local_error, const std::string& what,
                                            c10::Device device) {
  at::Tensor failed =
      at::tensor({static_cast<int32_t>(local_error.empty() ? 0 : 1)}, at::kInt).to(device);
  all_reduce_max(failed, "error_agreement");
  TORCH_CHECK_VALUE(local_error.empty(), local_error);
  TORCH_CHECK_VALUE(failed.cpu().item<int32_t>() == 0, "another rank failed to ", what,
                    " (its error says why); failing here too instead of waiting for it");
}

}  // namespace zeroshard
