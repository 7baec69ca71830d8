// A thin layer over c10d::ProcessGroup: the only code in zeroshard that issues
// collectives. It keeps backend quirks in one place (Gloo has no AVG, so
// averaging is SUM then divide by the caller), counts the bytes handed to each
// kind of collective, and can record an ordered log of what it issued.
//
// Thread-safety: one Communicator per optimizer, used from the thread that
// drives training (and autograd hooks on it). Not safe for concurrent calls.
//
// [Note: Work dies on the caller's thread]
// A backend's worker thread (Gloo's pt_gloo_runloop) holds its own reference
// to each Work until a moment after marking it complete, so when wait()
// returns and the caller drops its reference, the worker may be the one that
// destroys the Work and the tensors it holds. Destroying a tensor that has a
// Python object (a parameter view, a storage torch.save touched) takes the
// GIL; on a worker thread during interpreter exit that aborts the process
// ("terminate called without an active exception"). So waited Works are
// retired here and destroyed by the Communicator, on the caller's thread, once
// the backend has let go of them.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zeroshard/host_syncs.h"
#include "zeroshard/mapped_host_memory.h"
#include "zeroshard/rank_health.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace zeroshard {

// kNone marks log entries that are not collectives (e.g. "grad_ready").
enum class CollectiveKind { kNone, kAllReduce, kReduceScatter, kAllGather, kBroadcast };

const char* collective_kind_name(CollectiveKind kind);

// Bytes handed to collectives, by kind: each call's full size (a
// reduce-scatter's input, an all-gather's output).
struct CommStats {
  int64_t all_reduce_bytes = 0;
  int64_t reduce_scatter_bytes = 0;
  int64_t all_gather_bytes = 0;
  int64_t broadcast_bytes = 0;
  int64_t calls = 0;
  // Time the training thread spent blocked waiting for collectives.
  double wait_seconds = 0;
  int64_t total_bytes() const {
    return all_reduce_bytes + reduce_scatter_bytes + all_gather_bytes + broadcast_bytes;
  }
  // The *_bytes above are whole buffers (a reduce-scatter's input, an
  // all-gather's output); a rank sends less. By the ring algorithms' count, of
  // a reduce-scatter, all-gather or broadcast of B bytes each of N ranks sends
  // B(N-1)/N, of an all-reduce 2B(N-1)/N: what telemetry reports as traffic.
  double wire_bytes(int64_t world_size) const {
    const double share =
        world_size > 1 ? static_cast<double>(world_size - 1) / static_cast<double>(world_size) : 0;
    return share * static_cast<double>(2 * all_reduce_bytes + reduce_scatter_bytes +
                                       all_gather_bytes + broadcast_bytes);
  }
  void add(const CommStats& other) {
    all_reduce_bytes += other.all_reduce_bytes;
    reduce_scatter_bytes += other.reduce_scatter_bytes;
    all_gather_bytes += other.all_gather_bytes;
    broadcast_bytes += other.broadcast_bytes;
    calls += other.calls;
    wait_seconds += other.wait_seconds;
  }
};

// One entry of the optional event log.
struct CommEvent {
  std::string what;  // "launch" or "wait"
  CollectiveKind kind = CollectiveKind::kAllReduce;
  int64_t bytes = 0;
  std::string tag;  // caller's label, e.g. "group0/bucket2"
};

class Communicator;

// An in-flight collective. wait() is idempotent; a failed wait throws
// c10::DistBackendError naming the collective, the step and, where the
// Communicator has a store, the ranks that stopped responding.
class PendingCollective {
 public:
  PendingCollective() = default;
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, CollectiveKind kind, int64_t bytes,
                    std::string tag, Communicator* owner)
      : kind_(kind), bytes_(bytes), tag_(std::move(tag)), owner_(owner) {
    works_.push_back(std::move(work));
  }
  // After the wait, output = sum over dim 0 of received ([world, n]): the
  // local half of a reduce-scatter done as an all-to-all.
  void sum_chunks_into(at::Tensor received, at::Tensor output) {
    received_ = std::move(received);
    output_ = std::move(output);
  }
  // One collective made of several backend Works (an all-gather done as one
  // broadcast per rank): wait() waits for all of them.
  void also_wait_for(c10::intrusive_ptr<c10d::Work> work) { works_.push_back(std::move(work)); }
  PendingCollective(PendingCollective&& other) noexcept = default;
  PendingCollective& operator=(PendingCollective&& other) noexcept;
  PendingCollective(const PendingCollective&) = delete;
  PendingCollective& operator=(const PendingCollective&) = delete;
  // A collective dropped without wait() (an error path) is retired too.
  ~PendingCollective() { retire(); }
  void wait();
  bool pending() const { return !works_.empty(); }

 private:
  void retire() noexcept;

  // One Work, or several (see also_wait_for); empty once waited or retired.
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  CollectiveKind kind_ = CollectiveKind::kAllReduce;
  int64_t bytes_ = 0;
  std::string tag_;
  Communicator* owner_ = nullptr;  // outlives its collectives
  at::Tensor received_;            // see sum_chunks_into
  at::Tensor output_;
};

// FNV-1a of what a rank is about to do, the signature ranks compare through
// Communicator::extremes (the order check, stage 3's agreements). Kept
// positive, so that the maximum of its negation gives the minimum.
class Signature {
 public:
  void mix(int64_t value) {
    auto bits = static_cast<uint64_t>(value);
    for (int byte = 0; byte < 8; ++byte) {
      mix_byte(bits & 0xffu);
      bits >>= 8;
    }
  }
  void mix(const std::string& text) {
    for (unsigned char c : text) {
      mix_byte(c);
    }
  }
  int64_t value() const { return static_cast<int64_t>(hash_ >> 1); }

 private:
  void mix_byte(uint64_t byte) { hash_ = (hash_ ^ byte) * 1099511628211ull; }
  uint64_t hash_ = 1469598103934665603ull;
};

class Communicator {
 public:
  explicit Communicator(c10::intrusive_ptr<c10d::ProcessGroup> process_group);
  // Waits (bounded) until the backend has let go of every retired Work, then
  // destroys them here. See [Note: Work dies on the caller's thread].
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return process_group_; }

  // [Note: the host channel]
  // Much of what ranks exchange is host knowledge: which units each wants
  // gathered, which buckets are complete, which parameters had a gradient,
  // signatures, error strings. Sent over NCCL it must go to the device and
  // come back (two host syncs per exchange, each queued behind the
  // collectives in flight on the same stream), so it travels over a group
  // that takes host tensors: the group itself where it has a CPU backend
  // (Gloo; "cpu:gloo,cuda:nccl"), else a Gloo group over the same ranks
  // given by set_host_channel (Python builds one beside an NCCL group; C++
  // programs pass make_gloo_process_group's). Without one, host data goes
  // through the device and each exchange counts as a host sync
  // ([Note: host syncs, counted] in host_syncs.h). Its collectives run in the
  // same order on every rank, as any group's.
  //
  // `group`: the same ranks, in the same order, with a CPU backend.
  void set_host_channel(c10::intrusive_ptr<c10d::ProcessGroup> group);
  // No host channel: host data goes through the device (how an NCCL group
  // without one works; on CPU, how a test shows what that costs).
  void clear_host_channel() { host_group_.reset(); }
  bool has_host_channel() const { return host_group_ != nullptr; }
  // Where this group's data lives (the parameters' device): host data goes
  // there when there is no host channel.
  void set_device(c10::Device device) { device_ = device; }
  c10::Device device() const { return device_; }
  // Counts the host syncs made for this group (null: not counted).
  void set_host_sync_counter(HostSyncCounter* counter) { host_syncs_ = counter; }
  HostSyncCounter* host_sync_counter() const { return host_syncs_; }

  // Sums `tensor` across ranks in place (blocking).
  void all_reduce_sum(at::Tensor& tensor, const std::string& tag);
  // Element-wise max across ranks in place (blocking).
  void all_reduce_max(at::Tensor& tensor, const std::string& tag);
  // Collective, blocking, over the host channel: `tensor` lives on the host,
  // in and out (see [Note: the host channel]).
  void all_reduce_on_host(at::Tensor& tensor, c10d::ReduceOp::RedOpType op, const std::string& tag);
  // output (host) = the concatenation over ranks of input (host, equal sizes).
  void all_gather_on_host(at::Tensor& output, const at::Tensor& input, const std::string& tag);
  // root's `tensor` (host) on every rank, in place.
  void broadcast_on_host(at::Tensor& tensor, int64_t root, const std::string& tag);
  // Collective, blocking: the largest and the smallest `value` over the
  // ranks, from one MAX all-reduce of {value, -value} over the host channel;
  // how ranks compare a Signature (every rank has the same iff both equal its
  // own). Never order-checked: it is the check.
  std::pair<int64_t, int64_t> extremes(int64_t value, const std::string& tag);
  // output[i] = sum over ranks of input[rank * output.numel() + i] on this
  // rank. input.numel() == output.numel() * world_size().
  PendingCollective reduce_scatter_sum(at::Tensor& output, at::Tensor& input,
                                       const std::string& tag);
  // See ZeroOptions::gloo_reduce_scatter_all_to_all.
  void set_reduce_scatter_all_to_all(bool enabled) { all_to_all_reduce_scatter_ = enabled; }
  // The all-to-all reduce-scatter's receive rows held for the next call.
  int64_t cached_bytes() const { return receive_buffers_.cached_bytes(); }
  int64_t release_cached_buffers() { return receive_buffers_.clear(); }
  // output = concatenation over ranks of input. `input` may be this rank's
  // slice of `output` itself (nothing is copied then, on Gloo).
  PendingCollective all_gather(at::Tensor& output, at::Tensor& input, const std::string& tag);
  // See ZeroOptions::gloo_all_gather_broadcasts.
  void set_all_gather_broadcasts(bool enabled) { broadcast_all_gather_ = enabled; }
  void broadcast(at::Tensor& tensor, int64_t root, const std::string& tag);

  // [Note: Collective order check]
  // While enabled, every collective is preceded by a small all-reduce in which
  // the ranks compare what they are about to issue (kind, size, tag); ranks
  // about to issue different ones raise an error naming both collectives and
  // the step instead of deadlocking or mixing up buffers. Stage 3's hook
  // collectives skip it: the ranks agreed on them (AgreedScope), so ranks
  // running different modules is not an error there ([Note: Negotiated
  // collectives] in collective_agreement.h). A rank that stops issuing
  // collectives altogether is caught by the process group's timeout, which
  // is rethrown with the same context.
  void set_order_check_enabled(bool enabled) { order_check_ = enabled; }
  bool order_check_enabled() const { return order_check_; }
  // While alive, collectives skip the order check: the ranks agreed on them
  // beforehand ([Note: Negotiated collectives] in collective_agreement.h).
  class AgreedScope {
   public:
    explicit AgreedScope(Communicator& comm) : comm_(comm), previous_(comm.agreed_) {
      comm_.agreed_ = true;
    }
    ~AgreedScope() { comm_.agreed_ = previous_; }
    AgreedScope(const AgreedScope&) = delete;
    AgreedScope& operator=(const AgreedScope&) = delete;

   private:
    Communicator& comm_;
    bool previous_;
  };
  // [Note: Which call a rank is in]
  // The public call (step, full_state_dict, save_checkpoint, forward, ...)
  // this rank is in, named in errors when ranks diverge or a collective fails
  // ([Note: Ranks in different calls] in rank_health.h). Calls nest (the
  // Python full_state_dict calls the C++ full_parameters): the outermost one
  // is the user's, and names the rank's call. Memory only: the heartbeat
  // thread publishes it.
  void enter_call(const std::string& call);
  void exit_call();
  const std::string& current_call() const { return call_; }
  class CallScope {
   public:
    CallScope(Communicator& comm, const char* call) : comm_(comm) { comm_.enter_call(call); }
    ~CallScope() { comm_.exit_call(); }
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;

   private:
    Communicator& comm_;
  };
  // The training step reported in errors.
  void set_step(int64_t step) { step_ = step; }
  int64_t step() const { return step_; }

  // Since construction or the last reset_stats() (the user's counters).
  const CommStats& stats() const { return stats_; }
  void reset_stats() {
    before_reset_.add(stats_);
    stats_ = CommStats();
  }
  // Since construction, whatever reset_stats() did: what the engine's
  // telemetry differences, so that a user's reset cannot skew it.
  CommStats lifetime_stats() const {
    CommStats all = before_reset_;
    all.add(stats_);
    return all;
  }

  // The event log records launches and waits in order while enabled.
  void set_event_log_enabled(bool enabled) { log_enabled_ = enabled; }
  bool event_log_enabled() const { return log_enabled_; }
  const std::vector<CommEvent>& event_log() const { return log_; }
  // Records a non-collective event (e.g. a gradient hook firing) in the log.
  void note(const std::string& what, const std::string& tag) {
    if (log_enabled_) {
      log_.push_back(CommEvent{what, CollectiveKind::kNone, 0, tag});
    }
  }
  void clear_event_log() { log_.clear(); }

  // Destroys the retired Works the backend no longer references; returns how
  // many are still shared with it.
  size_t release_finished_work();
  // Waited Works still shared with the backend (bounded: the worker lets go
  // microseconds after completing one).
  size_t retired_work_count() const { return retired_.size(); }

  // Errors of failed collectives name the lost ranks: see [Note: Naming a lost
  // rank] in rank_health.h. `store` is the one the process group was created
  // with; `prefix` must be equal on every rank and unique per Communicator.
  void set_failure_store(c10::intrusive_ptr<c10d::Store> store, std::string prefix,
                         std::chrono::milliseconds report_window = std::chrono::seconds(3));
  // The store and key prefix given to set_failure_store (null when none):
  // asynchronous checkpoints agree through it, off the collective stream.
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  const std::string& store_prefix() const { return store_prefix_; }
  // Throws c10::DistBackendError for a collective that failed with `cause`.
  [[noreturn]] void raise_collective_failure(const std::string& description,
                                             const std::string& cause);

 private:
  void all_reduce(at::Tensor& tensor, c10d::ReduceOp::RedOpType op, const std::string& tag);
  // all_reduce_on_host without the order check (extremes is the check).
  void send_on_host(at::Tensor& tensor, c10d::ReduceOp::RedOpType op, const std::string& tag);
  PendingCollective track(c10::intrusive_ptr<c10d::Work> work, CollectiveKind kind, int64_t bytes,
                          const std::string& tag);
  void check_order(CollectiveKind kind, const at::Tensor& tensor, const std::string& tag);
  std::string backend_name(const at::Tensor& tensor) const;  // of the backend for its device
  bool is_gloo_on_cpu(const at::Tensor& tensor) const;

  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  // See [Note: the host channel]: process_group_ itself, another group over
  // the same ranks, or null (host data then goes through device_).
  c10::intrusive_ptr<c10d::ProcessGroup> host_group_;
  c10::Device device_ = c10::Device(c10::kCPU);
  HostSyncCounter* host_syncs_ = nullptr;  // owned by the optimizer
  int64_t rank_;
  int64_t world_size_;
  CommStats stats_;
  CommStats before_reset_;  // what reset_stats() cleared, for lifetime_stats()
  bool log_enabled_ = false;
  std::vector<CommEvent> log_;
  bool order_check_ = false;
  bool agreed_ = false;  // see AgreedScope
  int64_t step_ = 0;
  std::unordered_map<int64_t, std::string> checked_;  // signature -> description
  std::vector<c10::intrusive_ptr<c10d::Work>> retired_;
  std::unique_ptr<RankHealth> health_;  // with a failure store only
  c10::intrusive_ptr<c10d::Store> store_;
  std::string store_prefix_;
  bool all_to_all_reduce_scatter_ = true;
  bool broadcast_all_gather_ = true;
  HostBufferPool receive_buffers_;  // the all-to-all's rows, one step to the next

  // "rank 0 is in full_state_dict (...), rank 1 is in forward (...)"; empty
  // when this rank has no heartbeat (no failure store).
  std::string calls_of_ranks(const std::string& about_to_issue);
  std::string call_ = "";  // see enter_call
  int64_t call_depth_ = 0;
  std::string checking_;  // what check_order is checking, named while it waits

  friend class PendingCollective;
  void set_waiting(bool waiting, CollectiveKind kind, const std::string& tag);
  void on_waited(CollectiveKind kind, int64_t bytes, const std::string& tag, double seconds);
};

}  // namespace zeroshard
