// The gradient path: hooks hand gradients to the buckets, the reduction
// finishes at step() or clip_grad_norm(), the shard holds the average;
// stage 1 reduces from .grad (or during backward, see [Note: stage 1
// overlap]).
#include "gradient_reduction.h"

#include "zeroshard/shard_chunk.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace zeroshard {

namespace {

bool is_16_bit(const at::TensorOptions& options) {
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  return dtype == at::kHalf || dtype == at::kBFloat16;
}

void check_dense(const at::Tensor& grad, size_t g, int64_t i) {
  TORCH_CHECK_VALUE(grad.layout() == c10::kStrided, "parameter ", i, " of group ", g,
                    " has a sparse gradient; zeroshard does not support sparse "
                    "gradients (use a dense embedding: sparse=False)");
}

}  // namespace

GradientReduction::GradientReduction(Parts parts) : parts_(std::move(parts)) {
  const size_t groups = parts_.param_groups.size();
  shards_.resize(groups);
  if (parts_.options.stage() >= 2) {
    // Stages 2-3 accumulate into the shard across backward passes; stage 1
    // allocates it only while a step runs.
    for (size_t g = 0; g < groups; ++g) {
      if (!swapped(g)) {
        shards_[g] = at::zeros({parts_.layout.group(g).shard_numel()}, shard_options(g));
      }
    }
  }
  GradientBuckets::BucketComplete on_complete;
  if (Stage3Events* stage3 = parts_.stage3) {
    on_complete = [stage3](size_t g, size_t b) { stage3->bucket_reduced(g, b); };
  }
  buckets_ = std::make_unique<GradientBuckets>(
      parts_.layout, parts_.groups.shard(), parts_.grad_options,
      [this](size_t g) -> at::Tensor& { return shards_[g]; },
      static_cast<size_t>(parts_.options.max_buckets_in_flight()), parts_.options.overlap_comm(),
      std::move(on_complete));
  // See [Note: pre-divided 16-bit gradients]: one factor for every group, so
  // the shards and grad_shard_scale_ mean one thing whatever the group.
  if (std::any_of(parts_.grad_options.begin(), parts_.grad_options.end(), is_16_bit)) {
    buckets_->set_predivide(static_cast<double>(parts_.groups.data_parallel_world_size()));
  }
  if (NvmeGradientSwapper* swapper = parts_.swapper) {
    buckets_->set_gradient_sink(
        [this, swapper](size_t g, int64_t offset, const at::Tensor& reduced) {
          if (!swapper->swaps(g)) {
            return false;
          }
          if (!reduced.is_cpu()) {
            // The swap copies the slice to the host as it arrives: a wait per
            // bucket (the NVMe gradient swap is built for memory, not speed).
            parts_.host_syncs.count(HostSync::kOffloadGradientCopy);
          }
          swapper->accumulate(g, offset, reduced);
          return true;
        },
        [swapper] { swapper->flush(); });
  }
  // See [Note: the first round writes the shard]: a shard read in place, on
  // the buckets' device and in their dtype (not offloaded across devices,
  // not widened, not swapped to NVMe).
  std::vector<bool> first_round_writes(groups);
  for (size_t g = 0; g < groups; ++g) {
    const at::TensorOptions shard = shard_options(g);
    first_round_writes[g] = swapped(g) == nullptr &&
                            shard.device() == parts_.grad_options[g].device() &&
                            shard.dtype() == parts_.grad_options[g].dtype();
  }
  buckets_->set_first_round_writes_shard(std::move(first_round_writes));
  expect_current_gradients();
}

GradientReduction::~GradientReduction() {
  hooks_.reset();
  try {
    buckets_->wait_all();
  } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to report to in a destructor
  }
}

// ---- The hooks ----

bool GradientReduction::uses_hooks() const {
  const ZeroOptions& options = parts_.options;
  return options.stage() >= 2 ||
         (options.stage() == 1 && options.overlap_comm() && options.stage1_reduce_in_backward());
}

void GradientReduction::install_hooks() {
  std::vector<std::vector<at::Tensor>> params;
  for (const auto& group : parts_.param_groups) {
    params.push_back(group.params());
  }
  hooks_ = std::make_unique<GradientHooks>(
      params, [this](size_t g, int64_t i, const at::Tensor& param) { on_gradient(g, i, param); },
      [this](bool outermost) { end_backward(outermost); });
}

// Frozen parameters (requires_grad false) never deliver a gradient; buckets
// must not wait for them, or every later bucket would wait for the end of
// backward (and, at stage 3, stay gathered).
void GradientReduction::expect_current_gradients() {
  std::vector<std::vector<bool>> expects(parts_.param_groups.size());
  for (size_t g = 0; g < parts_.param_groups.size(); ++g) {
    for (const auto& param : parts_.param_groups[g].params()) {
      expects[g].push_back(param.requires_grad());
    }
  }
  expected_gradients_ = expects;
  buckets_->set_expects_gradient(std::move(expects));
}

// [Note: parameters unfrozen after construction]
// The buckets' expectations and the hooks follow requires_grad as it was at
// construction. A parameter unfrozen later (requires_grad_(True) after some
// steps: staged fine-tuning) delivers its gradient to .grad with no hook, and
// a bucket not expecting it can be reduced before it comes: at stage 3 its
// unit's bucket was complete, and reduced as zeros, before backward reached
// it, so it never trained. So before each round's first gradient (the first
// hook, stage 3's first pre-backward, the reduction in step()) the
// expectations follow requires_grad again: the bucket waits for it and, with
// no hook, takes it from .grad when backward ends. Outside backward (stage 3's
// model forward, the end of step()) it also gets its hook, so later rounds
// reduce it as it comes. A parameter frozen later needs nothing: its bucket
// waits for the end of backward, as for any parameter without a gradient.
void GradientReduction::follow_requires_grad(bool outside_backward) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  auto& groups = parts_.param_groups;
  bool changed = false;
  for (size_t g = 0; g < groups.size() && !changed; ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size() && !changed; ++i) {
      changed = params[i].requires_grad() != expected_gradients_[g][i];
    }
  }
  if (changed && !buckets_->round_open()) {
    expect_current_gradients();
  }
  if (outside_backward && hooks_) {
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& params = groups[g].params();
      for (size_t i = 0; i < params.size(); ++i) {
        hooks_->install(g, static_cast<int64_t>(i), params[i]);
      }
    }
  }
}

void GradientReduction::track_current_backward() {
  if (hooks_) {
    hooks_->track_current_backward();
  }
}

void GradientReduction::gradient_arrived(size_t group, int64_t index) {
  TORCH_CHECK_INDEX(group < parts_.param_groups.size() && index >= 0 &&
                        index < static_cast<int64_t>(parts_.param_groups[group].params().size()),
                    "gradient_arrived: no parameter ", index, " in group ", group);
  if (!hooks_) {
    return;  // stage 1 reduces from .grad inside step()
  }
  hooks_->track_current_backward();
  on_gradient(group, index, parts_.param_groups[group].params()[index]);
}

void GradientReduction::on_gradient(size_t g, int64_t i, const at::Tensor& param) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  // A rank waiting in a hook's collective is named "in backward" when the
  // ranks diverge ([Note: Which call a rank is in]), not "in no call".
  Communicator::CallScope call(parts_.groups.shard(), "backward");
  if (!gradient_sync_) {
    unsynced_gradients_ = true;
    gradient_delivered();
    return;  // no_sync: the gradient stays in .grad
  }
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) {
    return;
  }
  check_dense(grad, g, i);
  at::NoGradGuard no_grad;
  if (parts_.options.stage() == 1) {
    on_stage1_gradient(g, i, grad);
    return;
  }
  Communicator& shard = parts_.groups.shard();
  if (shard.event_log_enabled()) {  // no string building per gradient otherwise
    shard.note("grad_ready", "group" + std::to_string(g) + "/param" + std::to_string(i));
  }
  if (!buckets_->round_open()) {
    follow_requires_grad(/*outside_backward=*/false);
  }
  gradient_delivered();
  buckets_->add_gradient(g, i, grad);
  // The full gradient now lives in the bucket; only the shard stays.
  grad.reset();
}

// [Note: stage 1 overlap]
// Stage 1 keeps .grad (local, not averaged, as before), and with overlap_comm
// its hooks also copy each gradient into the buckets, so the reduce-scatters
// run during backward as at stage 2. Two things would make that copy stale,
// and then step() reduces from .grad instead, as without overlap: a second
// synced backward before the step (.grad then holds the sum; every rank runs
// the same backward passes, so every rank sees this at the same hook), and
// any change to a .grad after its hook (an unscale, a clip of the local
// gradients, a replaced tensor), caught by its version counter and agreed
// across ranks in one small all-reduce at the step.
void GradientReduction::on_stage1_gradient(size_t g, int64_t i, const at::Tensor& grad) {
  gradient_delivered();
  if (stage1_copies_.stale()) {
    return;
  }
  if (buckets_->reported(g, i) || (!buckets_->round_open() && buckets_->rounds_since_reset() > 0)) {
    stage1_copies_.mark_stale();  // a second backward since the last step
    return;
  }
  ensure_stage1_shards();
  Communicator& shard = parts_.groups.shard();
  if (shard.event_log_enabled()) {
    shard.note("grad_ready", "group" + std::to_string(g) + "/param" + std::to_string(i));
  }
  stage1_copies_.record(g, i, grad);
  buckets_->add_gradient(g, i, grad);
}

void GradientReduction::gradient_delivered() {
  if (phase_ == Phase::kEmpty) {
    phase_ = Phase::kAccumulating;
  } else if (phase_ == Phase::kReduced) {
    phase_ = Phase::kMixed;
  }
}

void GradientReduction::ensure_stage1_shards() {
  for (size_t g = 0; g < shards_.size(); ++g) {
    if (!shards_[g].defined()) {
      shards_[g] = new_stage1_shard(g);
    }
  }
}

// [Note: the stage-1 shard between steps]
// ZeRO-1 needs the gradient shard only from the reduction to the end of the
// update. It used to be a mapping of its own each step, unmapped when the
// step ended: every step then faulted Psi/N x 4 bytes in again, and on 2 CPU
// ranks the step phase swung between 180 and 560 ms from one step to the next
// (benchmarks/results/step_time_changes.md). It now comes from a pool of its
// own: freed when the step ends as before (device_bytes() does not count it
// between steps), but the mapping is kept for the next step, counted by
// cached_bytes() and given back by release_cached_buffers(), as CUDA's
// caching allocator keeps the same shard on a GPU until
// torch.cuda.empty_cache().
at::Tensor GradientReduction::new_stage1_shard(size_t g) {
  at::Tensor shard =
      stage1_shard_pool_.empty(parts_.layout.group(g).shard_numel(), shard_options(g));
  // Zeros only where a round adds into it ([Note: the first round writes
  // the shard]): a shard is allocated after reset(), before its first round.
  return buckets_->first_round_writes_shard(g) ? shard : shard.zero_();
}

bool GradientReduction::stage1_copies_current() {
  // A .grad set where no hook fired, replaced, or changed in place.
  const bool current = stage1_copies_.match(parts_.param_groups);
  at::Tensor stale = at::tensor({current ? 0 : 1}, at::kInt);
  parts_.groups.shard().all_reduce_on_host(stale, c10d::ReduceOp::MAX, "stage1_overlap_check");
  parts_.groups.max_across_replicas(stale, "stage1_overlap_check");
  return stale.item<int32_t>() == 0;
}

at::Tensor GradientReduction::take_leftover_grad(size_t g, int64_t i) {
  at::Tensor& grad = parts_.param_groups[g].params()[i].mutable_grad();
  at::Tensor taken = grad;
  grad.reset();
  return taken;
}

void GradientReduction::end_backward(bool outermost) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  Communicator::CallScope call(parts_.groups.shard(), "backward");
  at::NoGradGuard no_grad;
  const bool stage1 = parts_.options.stage() == 1;
  bool join_round = false;
  if (parts_.stage3) {
    // Agreed reductions and other ranks' gathers until every rank's backward
    // ended; the buckets left then are flushed in one order everywhere.
    join_round = parts_.stage3->wait_for_backward_end(outermost);
  }
  if (gradient_sync_ && !(stage1 && stage1_copies_.stale())) {
    // Another rank's backward delivered gradients and this one's none (data
    // took it past every trainable parameter): it runs the same round, its
    // buckets all zeros, as the others flush theirs.
    if (join_round) {
      buckets_->require_round();
    }
    // Stage 1 keeps .grad; stages 2 and 3 move what is left into the buckets.
    buckets_->flush(
        [this, stage1](size_t g, int64_t i) {
          return stage1 ? parts_.param_groups[g].params()[i].grad() : take_leftover_grad(g, i);
        },
        /*force_round=*/join_round);
    buckets_->wait_all();
  }
  // An inner (reentrant checkpoint) backward must not release what the
  // outer backward still needs.
  if (parts_.stage3 && outermost) {
    parts_.stage3->backward_finished();
  }
}

// ---- A step's reduction ----

void GradientReduction::finish(double loss_scale) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  const int stage = parts_.options.stage();
  if (phase_ == Phase::kReduced) {
    // Stage 1 without hooks reduced from .grad: a later backward shows in
    // .grad only (the same tensors, their version counters moved).
    if (stage != 1 || hooks_ || stage1_copies_.match(parts_.param_groups)) {
      return;
    }
    phase_ = Phase::kMixed;
  }
  TORCH_CHECK(phase_ != Phase::kMixed,
              "zeroshard: a backward pass delivered gradients (or .grad was changed) after the "
              "gradients were reduced (by clip_grad_norm, gradient_norm or unscale_) and before "
              "step(). The gradient "
              "shards hold the averaged gradient, which new gradients cannot be added to. Clip "
              "once, after the last backward of the step, then step(); call zero_grad() to "
              "start the step's gradients again.");
  at::NoGradGuard no_grad;
  follow_requires_grad(/*outside_backward=*/false);  // before this round, if none is open
  auto& groups = parts_.param_groups;
  bool reduced_in_backward = false;
  if (stage == 1 && hooks_) {
    // A rank whose backward delivered no gradient issues the round the others
    // issued during backward now, before the check that every rank makes.
    ensure_stage1_shards();
    buckets_->flush(
        [this](size_t g, int64_t i) { return parts_.param_groups[g].params()[i].grad(); },
        /*force_round=*/true);
    buckets_->wait_all();
    reduced_in_backward = stage1_copies_current();
  }
  if (reduced_in_backward) {
    // The hooks reduced during backward (see [Note: stage 1 overlap]).
  } else if (stage == 1) {
    // Full gradients are in .grad; feed them in flat-buffer order so buckets
    // complete, and launch, one after another.
    clear();
    for (size_t g = 0; g < groups.size(); ++g) {
      shards_[g] = new_stage1_shard(g);
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& params = groups[g].params();
      for (const ParamSlot& slot : parts_.layout.group(g).slots()) {
        const at::Tensor& grad = params[slot.param_index].grad();
        if (!grad.defined()) {
          continue;
        }
        check_dense(grad, g, slot.param_index);
        TORCH_CHECK_VALUE(grad.sizes() == params[slot.param_index].sizes(),
                          "gradient of parameter ", slot.param_index, " of group ", g,
                          " has shape ", grad.sizes(), " but the parameter has shape ",
                          params[slot.param_index].sizes());
        buckets_->add_gradient(g, slot.param_index, grad);
        stage1_copies_.record(g, slot.param_index, grad);  // what a later finish() compares
      }
    }
    buckets_->flush(nullptr, /*force_round=*/true);
  } else {
    // Gradients still in .grad (accumulated under no_sync) and buckets not yet
    // launched go now; a rank whose backward produced no gradient at all still
    // issues the round the other ranks issued. no_sync after a synced pass
    // needs a round of its own (every rank ran the same passes).
    if (unsynced_gradients_) {
      buckets_->require_round();
      unsynced_gradients_ = false;
    }
    buckets_->flush([this](size_t g, int64_t i) { return take_leftover_grad(g, i); },
                    /*force_round=*/true);
  }
  buckets_->wait_all();
  raise_swap_failure("reduce the gradients");
  reduce_across_replicas();
  // Gloo has no AVG: sum, then divide (what the buckets did not divide
  // before: [Note: pre-divided 16-bit gradients]); and undo the loss scale.
  const double ranks = parts_.options.gradient_divide_factor() > 0
                           ? parts_.options.gradient_divide_factor()
                           : static_cast<double>(parts_.groups.data_parallel_world_size());
  const double divisor = ranks * loss_scale / buckets_->predivide();
  if (parts_.defers_scale) {
    grad_shard_scale_ = 1.0 / divisor;
  } else if (divisor != 1.0) {
    for (auto& shard : shards_) {
      shard.div_(divisor);
    }
  }
  phase_ = Phase::kReduced;
}

// Hybrid sharding: the reduced shards summed over the replicas, once per
// step (Ψ/N elements per rank).
void GradientReduction::reduce_across_replicas() {
  Communicator* replica = parts_.groups.replica();
  if (replica == nullptr) {
    return;
  }
  const c10::Device device = parts_.placement.device();
  for (size_t g = 0; g < shards_.size(); ++g) {
    const std::string tag = "replicas/group" + std::to_string(g) + "/grad_shard";
    if (NvmeGradientSwapper* swapper = swapped(g)) {
      // From the swap file and back, a chunk at a time, through the device.
      const int64_t numel = swapper->numel(g);
      for (int64_t done = 0; done < numel; done += kGradientSwapBlockElements) {
        const int64_t length = std::min(kGradientSwapBlockElements, numel - done);
        at::Tensor sum = swapper->read(g, done, length).to(device);
        replica->all_reduce_sum(sum, tag);
        swapper->write(g, done,
                       read_to_host(sum, &parts_.host_syncs, HostSync::kOffloadGradientCopy));
      }
      raise_swap_failure("reduce the gradients across replicas");
      continue;
    }
    at::Tensor& shard = shards_[g];
    if (!shard.defined() || shard.numel() == 0) {
      continue;  // every replica has the same layout, so all skip alike
    }
    if (shard.device() == device) {
      replica->all_reduce_sum(shard, tag);
      continue;
    }
    // A host shard (offload) travels through the device (NCCL needs device
    // tensors), a chunk at a time: a whole fp32 copy of it on the device
    // would be twice the 16-bit shard that offload took off it. Every replica
    // has the same layout, so all issue the same chunks.
    const int64_t numel = shard.numel();
    for (int64_t done = 0; done < numel; done += kShardChunkElements) {
      at::Tensor host = shard.narrow(0, done, std::min(kShardChunkElements, numel - done));
      at::Tensor sum = host.to(device);
      replica->all_reduce_sum(sum, tag);
      host.copy_(read_to_host(sum, &parts_.host_syncs, HostSync::kOffloadGradientCopy));
    }
  }
}

void GradientReduction::scale(const at::Tensor& coefficient) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  if (parts_.defers_scale) {
    // The host kernel applies the factor: the host needs the number.
    grad_shard_scale_ *=
        read_to_host(coefficient, &parts_.host_syncs, HostSync::kClipCoefficient).item<double>();
    return;
  }
  for (auto& shard : shards_) {
    if (shard.defined()) {
      shard.mul_(coefficient.to(shard.device(), shard.scalar_type()));
    }
  }
}

void GradientReduction::clear() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  buckets_->wait_all();
  buckets_->reset();
  for (size_t g = 0; g < shards_.size(); ++g) {
    at::Tensor& shard = shards_[g];
    if (parts_.options.stage() == 1) {
      shard = at::Tensor();
    } else if (shard.defined() && !buckets_->first_round_writes_shard(g)) {
      // Otherwise the next round overwrites it before anything reads it
      // ([Note: the first round writes the shard]).
      shard.zero_();
    }
  }
  if (parts_.swapper) {
    parts_.swapper->clear();
  }
  phase_ = Phase::kEmpty;
  grad_shard_scale_ = 1.0;
  stage1_copies_.clear();
}

void GradientReduction::zero_grad() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (buckets_->round_open()) {
    // Only a backward pass that failed midway (an exception, e.g. out of
    // memory) leaves a round open here: its end-of-backward never ran.
    buckets_->abandon_round();
    if (hooks_) {
      hooks_->forget_backwards();
    }
    if (parts_.stage3) {
      parts_.stage3->backward_finished();
    }
  }
  clear();
  unsynced_gradients_ = false;
}

bool GradientReduction::reported(size_t group, int64_t index) const {
  return buckets_->reported(group, index);
}

void GradientReduction::for_each_chunk(size_t g, int64_t offset, int64_t length,
                                       const std::function<void(const at::Tensor&)>& fn) const {
  NvmeGradientSwapper* swapper = swapped(g);
  const at::Tensor& shard = shards_[g];
  if (!swapper && !shard.defined()) {
    return;  // stage 1 before its first reduction: no gradient yet
  }
  // A swapped shard is read a block at a time: each read is a transient of
  // its own, kept to the size of the blocks the swap already holds.
  const int64_t chunk = swapper ? kGradientSwapBlockElements : kShardChunkElements;
  for (int64_t done = 0; done < length; done += chunk) {
    const int64_t numel = std::min(chunk, length - done);
    fn(swapper ? swapper->read(g, offset + done, numel) : shard.narrow(0, offset + done, numel));
  }
}

void GradientReduction::raise_swap_failure(const std::string& what) {
  if (parts_.swapper == nullptr) {
    return;
  }
  const std::string agreed = parts_.groups.agree(parts_.swapper->failure(), "nvme_gradients");
  TORCH_CHECK(agreed.empty(), "could not ", what,
              ": the gradient shard in the NVMe swap space failed (this step's gradients are "
              "lost; zero_grad() and redo the step, or resume from the last checkpoint): ",
              agreed);
}

at::TensorOptions GradientReduction::shard_options(size_t g) const {
  return parts_.placement.gradient_shard_options(g, parts_.grad_options[g]);
}

NvmeGradientSwapper* GradientReduction::swapped(size_t g) const {
  return parts_.swapper != nullptr && parts_.swapper->swaps(g) ? parts_.swapper : nullptr;
}

// ---- Memory ----

int64_t GradientReduction::shard_bytes(bool on_host) const {
  int64_t bytes = 0;
  for (size_t g = 0; g < shards_.size(); ++g) {
    const at::Tensor& shard = shards_[g];
    if (shard.defined() && parts_.placement.gradient_shard_on_host(g) == on_host) {
      bytes += shard.numel() * static_cast<int64_t>(shard.element_size());
    }
  }
  return bytes;
}

int64_t GradientReduction::device_bytes() const {
  int64_t bytes = buckets_->live_staging_bytes() + shard_bytes(/*on_host=*/false);
  for (const auto& group : parts_.param_groups) {
    for (const auto& param : group.params()) {
      if (param.grad().defined()) {
        bytes += param.grad().numel() * static_cast<int64_t>(param.grad().element_size());
      }
    }
  }
  return bytes;
}

int64_t GradientReduction::host_bytes() const {
  return shard_bytes(/*on_host=*/true) + (parts_.swapper ? parts_.swapper->buffer_bytes() : 0);
}

int64_t GradientReduction::cached_bytes() const {
  return buckets_->cached_bytes() + stage1_shard_pool_.cached_bytes();
}

int64_t GradientReduction::release_cached_buffers() {
  return buckets_->release_cached_buffers() + stage1_shard_pool_.clear();
}

}  // namespace zeroshard
