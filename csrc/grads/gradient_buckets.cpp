#include "zeroshard/gradient_buckets.h"

#include "zeroshard/mapped_host_memory.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace zeroshard {
namespace {

int64_t bytes_of(const at::Tensor& tensor) {
  return tensor.numel() * static_cast<int64_t>(tensor.element_size());
}

}  // namespace

std::string bucket_tag(size_t group, size_t bucket) {
  return "group" + std::to_string(group) + "/bucket" + std::to_string(bucket);
}

GradientBuckets::GradientBuckets(const PartitionLayout& layout, Communicator& comm,
                                 std::vector<at::TensorOptions> grad_options,
                                 GradShardOf grad_shard_of, size_t max_in_flight,
                                 bool launch_eagerly, BucketComplete on_complete)
    : layout_(layout),
      comm_(comm),
      host_receiver_(std::max<size_t>(1, max_in_flight), comm.host_sync_counter()),
      grad_options_(std::move(grad_options)),
      grad_shard_of_(std::move(grad_shard_of)),
      on_complete_(std::move(on_complete)),
      max_in_flight_(std::max<size_t>(1, max_in_flight)),
      launch_eagerly_(launch_eagerly) {
  TORCH_INTERNAL_ASSERT(grad_options_.size() == layout_.groups().size());
  buckets_.resize(layout_.groups().size());
  reported_.resize(layout_.groups().size());
  for (size_t g = 0; g < layout_.groups().size(); ++g) {
    const GroupLayout& group = layout_.group(g);
    buckets_[g].resize(group.buckets().size());
    reported_[g].assign(group.num_params(), false);
    expects_gradient_.emplace_back(group.num_params(), true);
    flat_base_.push_back(static_cast<int64_t>(order_.size()));
    for (size_t b = 0; b < group.buckets().size(); ++b) {
      order_.emplace_back(g, b);
    }
  }
  start_round();
}

void GradientBuckets::start_round() {
  next_launch_ = 0;
  round_started_ = false;
  for (size_t g = 0; g < buckets_.size(); ++g) {
    const GroupLayout& group = layout_.group(g);
    for (size_t b = 0; b < buckets_[g].size(); ++b) {
      const Bucket& bucket = group.buckets()[b];
      BucketState& state = buckets_[g][b];
      state.filled.assign(bucket.end_slot - bucket.first_slot, false);
      state.pending = 0;
      state.launched = false;
      for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
        const ParamSlot& slot = group.slots()[s];
        state.pending += slot.numel > 0 && expects_gradient_[g][slot.param_index] ? 1 : 0;
      }
    }
  }
}

void GradientBuckets::set_expects_gradient(std::vector<std::vector<bool>> expects_gradient) {
  TORCH_INTERNAL_ASSERT(expects_gradient.size() == buckets_.size() && !round_started_);
  expects_gradient_ = std::move(expects_gradient);
  start_round();
}

void GradientBuckets::abandon_round() {
  wait_all();
  for (auto& group : buckets_) {
    for (auto& state : group) {
      if (state.staging.defined()) {
        release_staging(state.staging);
        state.staging = at::Tensor();
      }
    }
  }
  start_round();
  reset();
}

void GradientBuckets::ensure_staging(size_t g, size_t b) {
  BucketState& state = buckets_[g][b];
  if (state.staging.defined()) {
    return;
  }
  const Bucket& bucket = layout_.group(g).buckets()[b];
  state.staging = buffer_pool_.empty(bucket.numel, grad_options_[g]);
  live_staging_bytes_ += bytes_of(state.staging);
  peak_staging_bytes_ = std::max(peak_staging_bytes_, live_staging_bytes_);
}

void GradientBuckets::stage(at::Tensor target, const at::Tensor& grad, bool accumulate) const {
  const at::Tensor flat = grad.reshape({-1});
  if (predivide_ == 1.0) {
    accumulate ? target.add_(flat) : target.copy_(flat);
  } else if (accumulate) {
    target.add_(flat, 1.0 / predivide_);
  } else {
    // One pass: the division is the copy (mul_out converts dtypes as copy_).
    at::mul_out(target, flat.to(target.scalar_type()), 1.0 / predivide_);
  }
}

void GradientBuckets::release_staging(const at::Tensor& staging) {
  live_staging_bytes_ -= bytes_of(staging);
}

void GradientBuckets::add_gradient(size_t g, int64_t index, const at::Tensor& grad) {
  const GroupLayout& group = layout_.group(g);
  const ParamSlot& slot = group.slot_of_param(index);
  reported_[g][index] = true;
  if (slot.numel == 0) {
    return;
  }
  const auto b = static_cast<size_t>(slot.bucket_index);
  const Bucket& bucket = group.buckets()[b];
  BucketState& state = buckets_[g][b];
  const int64_t position = group.slot_of_param(index).flat_offset - bucket.flat_offset;
  const auto slot_in_bucket =
      static_cast<size_t>(&slot - group.slots().data()) - static_cast<size_t>(bucket.first_slot);
  // A bucket already launched this round has left the staging area. Every
  // backward pass (reentrant ones included) ends its round, so a parameter
  // cannot report twice in one round.
  TORCH_CHECK(!state.launched, "parameter ", index, " of group ", g,
              " produced a second gradient after its bucket was reduced in the same "
              "backward pass; autograd accumulates each parameter once per backward, so this "
              "is a zeroshard bug: please report it with the model");
  round_started_ = true;
  ensure_staging(g, b);
  at::Tensor target = state.staging.narrow(0, position, slot.numel);
  if (state.filled[slot_in_bucket]) {
    stage(target, grad, /*accumulate=*/true);
  } else {
    stage(target, grad, /*accumulate=*/false);
    state.filled[slot_in_bucket] = true;
    state.pending -= 1;
    completions_ += state.pending == 0 ? 1 : 0;
    if (state.pending == 0 && !order_adopted_) {
      completed_.emplace_back(g, b);
    }
    if (state.pending == 0 && on_complete_) {
      on_complete_(g, b);
    }
  }
  if (launch_eagerly_ && !launch_on_agreement_) {
    launch_ready();
  }
}

std::vector<int64_t> GradientBuckets::ready_buckets() const {
  std::vector<int64_t> ready;
  if (!launch_eagerly_ || !round_started_) {
    return ready;
  }
  for (size_t g = 0; g < buckets_.size(); ++g) {
    for (size_t b = 0; b < buckets_[g].size(); ++b) {
      if (buckets_[g][b].pending == 0 && !buckets_[g][b].launched) {
        ready.push_back(flat_base_[g] + static_cast<int64_t>(b));
      }
    }
  }
  return ready;
}

void GradientBuckets::launch_agreed(const std::vector<int64_t>& flat_buckets) {
  if (flat_buckets.empty()) {
    return;
  }
  TORCH_INTERNAL_ASSERT(round_started_, "agreed buckets outside a round");
  std::vector<bool> agreed(order_.size(), false);
  for (int64_t flat : flat_buckets) {
    agreed.at(static_cast<size_t>(flat)) = true;
  }
  // Launch order, the same on every rank.
  for (size_t i = next_launch_; i < order_.size(); ++i) {
    const auto [g, b] = order_[i];
    if (agreed[static_cast<size_t>(flat_base_[g]) + b] && !buckets_[g][b].launched) {
      TORCH_INTERNAL_ASSERT(buckets_[g][b].pending == 0, "agreed bucket ", bucket_tag(g, b),
                            " is not complete on this rank");
      launch(g, b);
    }
  }
  while (next_launch_ < order_.size() &&
         buckets_[order_[next_launch_].first][order_[next_launch_].second].launched) {
    ++next_launch_;
  }
  if (next_launch_ == order_.size()) {
    finish_round();
  }
}

void GradientBuckets::launch_ready() {
  while (next_launch_ < order_.size()) {
    const auto [g, b] = order_[next_launch_];
    if (buckets_[g][b].pending > 0) {
      return;
    }
    launch(g, b);
    ++next_launch_;
  }
  // Every bucket of the round launched.
  finish_round();
}

// [Note: launch order]
// Every rank must launch the buckets' collectives in one order. The first
// round uses layout order (reverse registration, as gradients usually
// arrive); a bucket whose gradient comes late (a tied input embedding, a
// parameter used early in forward) then holds back every bucket after it. So
// after the first eager round the buckets launch in the order they completed
// in it, rank 0's order sent to all (DDP rebuilds its buckets the same
// way, from the first iteration's arrival order). Buckets that never
// completed (unused parameters) go last, in layout order.
void GradientBuckets::finish_round() {
  rounds_since_reset_ += 1;
  shard_holds_round_ = true;
  // Every rank adopts (an exchange), whatever it saw: a rank whose buckets
  // all lacked a gradient (a parameter only other ranks used) completed none
  // of them, and skipping the exchange there left the others waiting in it.
  if (launch_eagerly_ && !order_adopted_) {
    adopt_completion_order();
  }
  start_round();
}

void GradientBuckets::adopt_completion_order() {
  order_adopted_ = true;
  std::vector<std::pair<size_t, size_t>> order = completed_;
  for (const auto& id : order_) {
    if (std::find(order.begin(), order.end(), id) == order.end()) {
      order.push_back(id);
    }
  }
  completed_.clear();
  completed_.shrink_to_fit();
  std::vector<int64_t> flat;
  for (const auto& [g, b] : order) {
    flat.push_back(static_cast<int64_t>(g));
    flat.push_back(static_cast<int64_t>(b));
  }
  // Rank 0's order on every rank: host data, so over the host channel
  // ([Note: the host channel]).
  at::Tensor agreed = at::tensor(flat, at::kLong);
  comm_.broadcast_on_host(agreed, /*root=*/0, "bucket_order");
  const auto* data = agreed.data_ptr<int64_t>();
  for (size_t i = 0; i < order.size(); ++i) {
    order_[i] = {static_cast<size_t>(data[2 * i]), static_cast<size_t>(data[2 * i + 1])};
  }
}

void GradientBuckets::launch(size_t g, size_t b) {
  const GroupLayout& group = layout_.group(g);
  const Bucket& bucket = group.buckets()[b];
  BucketState& state = buckets_[g][b];
  ensure_staging(g, b);
  // Zero what no gradient wrote: padding (between slots too: [Note: aligned
  // slots]) and parameters that had none, in as few ranges as there are.
  int64_t zero_from = 0;  // start of the range of unwritten elements so far
  for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
    const ParamSlot& slot = group.slots()[s];
    if (slot.numel == 0 || !state.filled[s - bucket.first_slot]) {
      continue;
    }
    const int64_t position = slot.flat_offset - bucket.flat_offset;
    if (position > zero_from) {
      state.staging.narrow(0, zero_from, position - zero_from).zero_();
    }
    zero_from = position + slot.numel;
  }
  if (bucket.numel > zero_from) {
    state.staging.narrow(0, zero_from, bucket.numel - zero_from).zero_();
  }
  while (in_flight_.size() >= max_in_flight_) {
    complete_oldest();
  }
  state.launched = true;
  InFlight entry;
  entry.staging = std::move(state.staging);
  // See [Note: the first round writes the shard].
  entry.in_shard = !shard_holds_round_ && first_round_writes_shard(g);
  entry.output = entry.in_shard
                     ? grad_shard_of_(g).narrow(0, bucket.shard_offset, bucket.shard_numel)
                     : buffer_pool_.empty(bucket.shard_numel, grad_options_[g]);
  entry.group = g;
  entry.bucket = b;
  comm_.note("bucket_ready", bucket_tag(g, b));
  entry.work = comm_.reduce_scatter_sum(entry.output, entry.staging, bucket_tag(g, b));
  in_flight_.push_back(std::move(entry));
}

void GradientBuckets::complete_oldest() {
  in_flight_.front().work.wait();
  // Out of the queue before its slice is delivered: a delivery that throws
  // must not leave it to be delivered again by the next wait_all().
  InFlight entry = std::move(in_flight_.front());
  in_flight_.pop_front();
  const Bucket& bucket = layout_.group(entry.group).buckets()[entry.bucket];
  if (entry.in_shard) {
    // Reduced in place.
  } else if (!sink_ || !sink_(entry.group, bucket.shard_offset, entry.output)) {
    host_receiver_.receive(
        grad_shard_of_(entry.group).narrow(0, bucket.shard_offset, bucket.shard_numel),
        entry.output);
  }
  release_staging(entry.staging);
}

void GradientBuckets::flush(const LeftoverGradient& leftover, bool force_round) {
  if (!round_started_ && !(force_round && rounds_since_reset_ == 0)) {
    return;
  }
  round_started_ = true;
  for (; next_launch_ < order_.size(); ++next_launch_) {
    const auto [g, b] = order_[next_launch_];
    const GroupLayout& group = layout_.group(g);
    const Bucket& bucket = group.buckets()[b];
    BucketState& state = buckets_[g][b];
    if (state.launched) {
      continue;  // agreed on during backward (launch_agreed)
    }
    for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
      const ParamSlot& slot = group.slots()[s];
      if (slot.numel == 0 || state.filled[s - bucket.first_slot] || !leftover) {
        continue;
      }
      at::Tensor grad = leftover(g, slot.param_index);
      if (grad.defined()) {
        ensure_staging(g, b);
        stage(state.staging.narrow(0, slot.flat_offset - bucket.flat_offset, slot.numel), grad,
              /*accumulate=*/false);
        state.filled[s - bucket.first_slot] = true;
        reported_[g][slot.param_index] = true;
      }
    }
    launch(g, b);
  }
  finish_round();
}

void GradientBuckets::wait_all() {
  while (!in_flight_.empty()) {
    complete_oldest();
  }
  host_receiver_.drain();
  if (sink_drain_) {
    sink_drain_();
  }
}

void GradientBuckets::reset() {
  TORCH_INTERNAL_ASSERT(in_flight_.empty() && !round_started_,
                        "gradient buckets reset with work outstanding");
  for (auto& flags : reported_) {
    std::fill(flags.begin(), flags.end(), false);
  }
  rounds_since_reset_ = 0;
  shard_holds_round_ = false;
}

void GradientBuckets::set_first_round_writes_shard(std::vector<bool> writes) {
  TORCH_INTERNAL_ASSERT(writes.size() == buckets_.size() && in_flight_.empty() && !round_started_);
  first_round_writes_shard_ = std::move(writes);
}

}  // namespace zeroshard
