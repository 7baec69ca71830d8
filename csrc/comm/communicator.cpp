#include "zeroshard/communicator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <functional>
#include <thread>
#include <tuple>

namespace zeroshard {
namespace {

int64_t bytes_of(const at::Tensor& tensor) {
  return tensor.numel() * static_cast<int64_t>(tensor.element_size());
}

bool has_cpu_backend(const c10d::ProcessGroup& group) {
  for (const c10::Device& device : group.getDeviceTypes()) {
    if (device.is_cpu()) {
      return true;
    }
  }
  return false;
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

PendingCollective& PendingCollective::operator=(PendingCollective&& other) noexcept {
  if (this != &other) {
    retire();
    works_ = std::move(other.works_);
    other.works_.clear();
    kind_ = other.kind_;
    bytes_ = other.bytes_;
    tag_ = std::move(other.tag_);
    owner_ = other.owner_;
    received_ = std::move(other.received_);
    output_ = std::move(other.output_);
  }
  return *this;
}

void PendingCollective::retire() noexcept {
  if (owner_ != nullptr) {
    try {
      for (auto& work : works_) {
        owner_->retired_.push_back(std::move(work));
      }
    } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory; the worker may free it
    }
  }
  works_.clear();
}

void PendingCollective::wait() {
  if (works_.empty()) {
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    if (owner_ != nullptr) {
      owner_->set_waiting(true, kind_, tag_);
    }
    for (auto& work : works_) {
      work->wait();
    }
    if (owner_ != nullptr) {
      owner_->set_waiting(false, kind_, tag_);
    }
  } catch (const std::exception& e) {  // Gloo rethrows its own IoException, not a c10::Error
    // The other Works of this collective (an all-gather as broadcasts) may
    // still write into its output, which the caller may free once this
    // throws: they finish first, their own errors dropped (this one reports).
    for (auto& work : works_) {
      try {
        work->wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): the first failure reports
      }
    }
    retire();
    if (owner_ == nullptr) {
      throw;
    }
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    owner_->raise_collective_failure(std::string(collective_kind_name(kind_)) + " '" + tag_ +
                                         "' of " + std::to_string(bytes_) + " bytes",
                                     error ? error->what_without_backtrace() : e.what());
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (owner_ != nullptr) {
    owner_->on_waited(kind_, bytes_, tag_, seconds);
  }
  retire();
  if (received_.defined()) {
    at::sum_out(output_, received_, /*dim=*/0);
    received_ = at::Tensor();
    output_ = at::Tensor();
  }
}

void Communicator::on_waited(CollectiveKind kind, int64_t bytes, const std::string& tag,
                             double seconds) {
  stats_.wait_seconds += seconds;
  if (log_enabled_) {
    log_.push_back(CommEvent{"wait", kind, bytes, tag});
  }
}

Communicator::Communicator(c10::intrusive_ptr<c10d::ProcessGroup> process_group)
    : process_group_(std::move(process_group)) {
  TORCH_CHECK_VALUE(process_group_, "zeroshard needs a process group; got a null one");
  rank_ = process_group_->getRank();
  world_size_ = process_group_->getSize();
  if (has_cpu_backend(*process_group_)) {
    host_group_ = process_group_;
  }
}

void Communicator::set_host_channel(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  TORCH_CHECK_VALUE(group, "set_host_channel needs a process group; got a null one");
  TORCH_CHECK_VALUE(group->getSize() == world_size_ && group->getRank() == rank_,
                    "the host channel must span the same ranks in the same order as its group: "
                    "it has rank ",
                    group->getRank(), " of ", group->getSize(), ", the group rank ", rank_, " of ",
                    world_size_);
  TORCH_CHECK_VALUE(has_cpu_backend(*group),
                    "the host channel must take host tensors (a Gloo group); this group has no "
                    "CPU backend");
  host_group_ = std::move(group);
}

Communicator::~Communicator() {
  // The worker drops its reference microseconds after completing the Work;
  // a worker that never does (a hung backend) must not hang the exit, so after
  // the deadline the remaining Works are leaked rather than left to it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (release_finished_work() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  for (auto& work : retired_) {
    work.release();  // NOLINT(bugprone-unused-return-value): leaked on purpose
  }
}

void Communicator::set_failure_store(c10::intrusive_ptr<c10d::Store> store, std::string prefix,
                                     std::chrono::milliseconds report_window) {
  health_.reset();
  store_ = store;
  store_prefix_ = prefix;
  if (store && world_size_ > 1) {
    health_ = std::make_unique<RankHealth>(std::move(store), std::move(prefix), rank_, world_size_,
                                           report_window);
    health_->set_call(call_);
  }
}

void Communicator::enter_call(const std::string& call) {
  if (call_depth_++ == 0) {
    call_ = call;
    if (health_) {
      health_->set_call(call_);
    }
  }
}

void Communicator::exit_call() {
  if (call_depth_ > 0 && --call_depth_ == 0) {
    call_.clear();
    if (health_) {
      health_->set_call("");
    }
  }
}

void Communicator::set_waiting(bool waiting, CollectiveKind kind, const std::string& tag) {
  if (!health_) {
    return;
  }
  if (!waiting) {
    health_->set_waiting(false, "");
  } else if (!checking_.empty()) {
    health_->set_waiting(true, "waiting in the order check before " + checking_);
  } else {
    health_->set_waiting(
        true, std::string("waiting in ") + collective_kind_name(kind) + " '" + tag + "'");
  }
}

namespace {

std::string rank_list(const std::vector<int64_t>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return text + (ranks.size() == 1 ? " is" : " are");
}

// "rank 0 is in step (...), rank 1 is in save_checkpoint (...)" over the
// known activities; `differ` tells whether their calls differ.
std::string describe_activities(const std::vector<std::optional<RankActivity>>& activity,
                                bool& differ) {
  std::string text;
  const RankActivity* first = nullptr;
  differ = false;
  for (size_t r = 0; r < activity.size(); ++r) {
    if (!activity[r]) {
      continue;
    }
    text += (text.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " is " +
            activity[r]->describe();
    if (first == nullptr) {
      first = &*activity[r];
    } else if (activity[r]->call != first->call) {
      differ = true;
    }
    differ = differ || activity[r]->state == 'd';
  }
  return text;
}

}  // namespace

void Communicator::raise_collective_failure(const std::string& description,
                                            const std::string& cause) {
  // See [Note: Naming a lost rank] and [Note: Ranks in different calls].
  std::string who;
  if (health_) {
    const RankReport report = health_->diagnose(step_);
    bool differ = false;
    const std::string calls = describe_activities(report.activity, differ);
    if (!report.store_reachable) {
      who = differ ? "the store is unreachable (it may have gone with the rank that raised); "
                   : "the store is unreachable (its host rank may be the one lost); ";
    }
    if (!report.lost.empty()) {
      who += rank_list(report.lost) + " lost (killed or crashed: no heartbeat in " +
             std::to_string(health_->report_window().count()) + " ms of watching); ";
    } else if (!report.stalled.empty()) {
      who += rank_list(report.stalled) +
             " stalled (alive, but running outside zeroshard's calls while the others waited "
             "in a collective); each rank's call: " +
             calls + "; ";
    } else if (differ) {
      who += "the ranks are in different calls, so their collectives do not match: " + calls +
             ". Every rank must make the same calls in the same order (a call such as "
             "full_state_dict() or save_checkpoint() on every rank, the same number of steps); ";
    } else if (report.store_reachable) {
      who += "every rank reported a failure; ";
    }
  }
  C10_THROW_ERROR(DistBackendError,
                  "zeroshard: rank " + std::to_string(rank_) + " of " +
                      std::to_string(world_size_) + ": " + description + " failed at step " +
                      std::to_string(step_) + ": " + who +
                      "a rank that stops stops every other rank at its next collective (bounded "
                      "by the process group's timeout). Cause: " +
                      cause);
}

size_t Communicator::release_finished_work() {
  size_t kept = 0;
  for (auto& work : retired_) {
    if (work.use_count() > 1) {
      retired_[kept++] = std::move(work);
    } else {
      work.reset();  // the last reference: destroyed on this thread
    }
  }
  retired_.resize(kept);
  return kept;
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
  release_finished_work();
  return PendingCollective(std::move(work), kind, bytes, tag, this);
}

void Communicator::check_order(CollectiveKind kind, const at::Tensor& tensor,
                               const std::string& tag) {
  if (!order_check_ || agreed_ || world_size_ == 1) {
    return;
  }
  const std::string description = std::string(collective_kind_name(kind)) + " '" + tag + "' of " +
                                  std::to_string(tensor.numel()) + " elements";
  Signature hash;
  hash.mix(description);
  const int64_t signature = hash.value();
  checked_.emplace(signature, description);
  int64_t largest = 0;
  int64_t smallest = 0;
  checking_ = description;
  try {
    std::tie(largest, smallest) = extremes(signature, "order_check");
    checking_.clear();
  } catch (const c10::DistBackendError& e) {
    checking_.clear();
    // Already names the lost ranks; say what this rank was about to do.
    C10_THROW_ERROR(DistBackendError,
                    std::string(e.what_without_backtrace()) + " (before issuing " + description +
                        "; if no rank was lost, did the ranks run different modules or a "
                        "different number of steps?)");
  }
  if (largest == signature && smallest == signature) {
    return;
  }
  const int64_t other = largest != signature ? largest : smallest;
  const auto known = checked_.find(other);
  const std::string calls = calls_of_ranks(description);
  // DistBackendError, as the other ranks' failed collective raises: one kind
  // of exception for one divergence, whichever rank saw it first.
  C10_THROW_ERROR(
      DistBackendError,
      c10::str("the ranks' collectives diverged at step ", step_, ": rank ", rank_,
               " is about to issue ", description, " but another rank issued ",
               known != checked_.end() ? known->second : std::string("a different collective"),
               calls.empty() ? std::string()
                             : ". The ranks are in different calls: " + calls +
                                   ". Every rank must make the same calls in the same order (a "
                                   "call such as full_state_dict() or save_checkpoint() on every "
                                   "rank, the same number of steps)",
               ". Every rank must run the same modules in the same order (stage 3 gathers "
               "parameters from module hooks); data-dependent control flow must agree across "
               "ranks"));
}

std::string Communicator::calls_of_ranks(const std::string& about_to_issue) {
  if (!health_) {
    return "";
  }
  bool differ = false;
  return describe_activities(health_->report_divergence(step_, "about to issue " + about_to_issue),
                             differ);
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

std::pair<int64_t, int64_t> Communicator::extremes(int64_t value, const std::string& tag) {
  at::Tensor both = at::tensor({value, -value}, at::kLong);
  send_on_host(both, c10d::ReduceOp::MAX, tag);
  const auto* e = both.data_ptr<int64_t>();
  return {e[0], -e[1]};
}

namespace {

// A host tensor's collective ([Note: the host channel]): over the host group
// in place, or, without one, through a device copy read back (a counted sync).
void through_host_channel(
    at::Tensor& tensor, c10d::ProcessGroup* host_group, c10d::ProcessGroup& group,
    c10::Device device, HostSyncCounter* host_syncs,
    const std::function<void(c10d::ProcessGroup&, std::vector<at::Tensor>&)>& run) {
  if (host_group != nullptr) {
    std::vector<at::Tensor> tensors{tensor};
    run(*host_group, tensors);
    return;
  }
  std::vector<at::Tensor> tensors{tensor.to(device)};
  run(group, tensors);
  tensor.copy_(read_to_host(tensors[0], host_syncs, HostSync::kHostDataOnDevice));
}

}  // namespace

void Communicator::all_reduce_on_host(at::Tensor& tensor, c10d::ReduceOp::RedOpType op,
                                      const std::string& tag) {
  TORCH_INTERNAL_ASSERT(tensor.device().is_cpu(), "all_reduce_on_host takes host tensors");
  check_order(CollectiveKind::kAllReduce, tensor, tag);
  send_on_host(tensor, op, tag);
}

void Communicator::send_on_host(at::Tensor& tensor, c10d::ReduceOp::RedOpType op,
                                const std::string& tag) {
  if (world_size_ == 1) {
    return;  // the identity, wherever the group's backend is
  }
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  through_host_channel(tensor, host_group_.get(), *process_group_, device_, host_syncs_,
                       [&](c10d::ProcessGroup& group, std::vector<at::Tensor>& tensors) {
                         track(group.allreduce(tensors, options), CollectiveKind::kAllReduce,
                               bytes_of(tensor), tag)
                             .wait();
                       });
}

void Communicator::broadcast_on_host(at::Tensor& tensor, int64_t root, const std::string& tag) {
  TORCH_INTERNAL_ASSERT(tensor.device().is_cpu(), "broadcast_on_host takes host tensors");
  if (world_size_ == 1) {
    return;
  }
  check_order(CollectiveKind::kBroadcast, tensor, tag);
  c10d::BroadcastOptions options;
  options.rootRank = root;
  through_host_channel(tensor, host_group_.get(), *process_group_, device_, host_syncs_,
                       [&](c10d::ProcessGroup& group, std::vector<at::Tensor>& tensors) {
                         track(group.broadcast(tensors, options), CollectiveKind::kBroadcast,
                               bytes_of(tensor), tag)
                             .wait();
                       });
}

void Communicator::all_gather_on_host(at::Tensor& output, const at::Tensor& input,
                                      const std::string& tag) {
  TORCH_INTERNAL_ASSERT(input.device().is_cpu() && output.device().is_cpu(),
                        "all_gather_on_host takes host tensors");
  TORCH_INTERNAL_ASSERT(output.numel() == input.numel() * world_size_,
                        "all_gather_on_host: output must be world_size times the input");
  if (world_size_ == 1) {
    output.copy_(input.reshape({-1}));
    return;
  }
  check_order(CollectiveKind::kAllGather, output, tag);
  if (host_group_) {
    at::Tensor source = input.contiguous().clone();
    track(host_group_->_allgather_base(output, source), CollectiveKind::kAllGather,
          bytes_of(output), tag)
        .wait();
    return;
  }
  at::Tensor source = input.to(device_);
  at::Tensor gathered = at::empty(output.sizes(), source.options());
  track(process_group_->_allgather_base(gathered, source), CollectiveKind::kAllGather,
        bytes_of(output), tag)
      .wait();
  output.copy_(read_to_host(gathered, host_syncs_, HostSync::kHostDataOnDevice));
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
  if (all_to_all_reduce_scatter_ && is_gloo_on_cpu(input)) {
    // Chunk r of the input goes to rank r; received row j came from rank j.
    // Summing the rows in rank order is the same on every rank.
    at::Tensor flat = receive_buffers_.empty(input.numel(), input.options());
    at::Tensor received = flat.view({world_size_, output.numel()});
    std::vector<int64_t> equal_splits;
    c10d::AllToAllOptions options;
    PendingCollective pending =
        track(process_group_->alltoall_base(flat, input, equal_splits, equal_splits, options),
              CollectiveKind::kReduceScatter, bytes_of(input), tag);
    pending.sum_chunks_into(std::move(received), output);
    return pending;
  }
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
  TORCH_INTERNAL_ASSERT(output.is_contiguous(), "all_gather: the output must be contiguous");
  const int64_t n = input.numel();
  at::Tensor own = output.view({-1}).narrow(0, rank_ * n, n);
  const bool in_place = input.is_contiguous() && input.data_ptr() == own.data_ptr() &&
                        input.scalar_type() == own.scalar_type();
  if (broadcast_all_gather_ && is_gloo_on_cpu(output)) {
    // [Note: an all-gather as broadcasts]
    // Gloo's allgather receives into a fresh buffer of the output's size and
    // then copies it into the output: an allocation (page faults) and a full
    // copy per call. A broadcast reads and writes its tensor in place, so one
    // per rank, rooted at that rank's slice, moves the same bytes straight
    // into `output` (benchmarks/results/paired_allgather.md: stage 2's step
    // phase 138 -> 100 ms on 2 ranks). Every rank issues the W broadcasts in
    // the same order.
    if (!in_place) {
      own.copy_(input.reshape({-1}));
    }
    PendingCollective pending;
    for (int64_t root = 0; root < world_size_; ++root) {
      std::vector<at::Tensor> slice{output.view({-1}).narrow(0, root * n, n)};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      c10::intrusive_ptr<c10d::Work> work = process_group_->broadcast(slice, options);
      if (root == 0) {
        pending = track(std::move(work), CollectiveKind::kAllGather, bytes_of(output), tag);
      } else {
        pending.also_wait_for(std::move(work));
      }
    }
    return pending;
  }
  // NCCL all-gathers in place when the input is this rank's slice of the
  // output (ncclAllGather's documented in-place case; FSDP2 gathers so), which
  // saves a copy of every bucket's shard each step. Other backends' all-gather
  // must not read from what it writes.
  at::Tensor source = in_place && backend_name(output) != "nccl" ? input.clone() : input;
  return track(process_group_->_allgather_base(output, source), CollectiveKind::kAllGather,
               bytes_of(output), tag);
}

std::string Communicator::backend_name(const at::Tensor& tensor) const {
  return process_group_->getBackend(tensor.device().type())->getBackendName();
}

bool Communicator::is_gloo_on_cpu(const at::Tensor& tensor) const {
  return tensor.device().is_cpu() && backend_name(tensor) == "gloo";
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

}  // namespace zeroshard
