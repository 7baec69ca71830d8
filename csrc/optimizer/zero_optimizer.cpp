#include "zeroshard/zero_optimizer.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <unordered_map>

namespace zeroshard {

void validate_zero_options(const ZeroOptions& options, int64_t world_size) {
  TORCH_CHECK_VALUE(options.stage() == 1 || options.stage() == 2, "unsupported ZeRO stage ",
                    options.stage(),
                    "; zeroshard implements stage 1 (optimizer state sharding) and stage 2 "
                    "(optimizer state and gradient sharding). Stage 3 is not implemented yet");
  TORCH_CHECK_VALUE(options.max_norm() >= 0, "max_norm must be >= 0 (0 turns clipping off), got ",
                    options.max_norm());
  TORCH_CHECK_VALUE(options.max_buckets_in_flight() >= 1,
                    "max_buckets_in_flight must be >= 1, got ", options.max_buckets_in_flight());
  TORCH_CHECK_VALUE(options.reduce_bucket_size() >= 1,
                    "reduce_bucket_size must be >= 1 element, got ", options.reduce_bucket_size());
  TORCH_CHECK_VALUE(
      options.broadcast_from_rank() >= 0 && options.broadcast_from_rank() < world_size,
      "broadcast_from_rank must be a rank in [0, ", world_size, "), got ",
      options.broadcast_from_rank());
}

ZeroOptimizer::ZeroOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                             const torch::optim::OptimizerOptions& inner_defaults,
                             ZeroOptions options)
    : Optimizer(param_groups, inner_defaults.clone()),
      inner_kind_(inner_optimizer_kind_of(inner_defaults)),
      options_(options) {
  initialize(std::move(process_group));
}

ZeroOptimizer::ZeroOptimizer(std::vector<at::Tensor> params,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                             const torch::optim::OptimizerOptions& inner_defaults,
                             ZeroOptions options)
    : ZeroOptimizer(
          std::vector<torch::optim::OptimizerParamGroup>{
              torch::optim::OptimizerParamGroup(std::move(params))},
          std::move(process_group), inner_defaults, options) {}

void ZeroOptimizer::initialize(c10::intrusive_ptr<c10d::ProcessGroup> process_group) {
  TORCH_CHECK_VALUE(process_group, "ZeroOptimizer needs a process group; got a null one");
  comm_ = std::make_unique<Communicator>(std::move(process_group));
  std::string error;
  try {
    validate_zero_options(options_, comm_->world_size());
    for (auto& group : param_groups_) {
      validate_inner_options(inner_kind_, group.options());
    }
    TORCH_CHECK_VALUE(!options_.fused() || inner_kind_ != InnerOptimizerKind::kSGD,
                      "fused=True is available for Adam and AdamW, not SGD");
    validate_parameters();
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  // Usually every rank passes the same arguments and fails alike; if only some
  // do, the others must not wait for them in the first collective.
  const auto& first = param_groups_.empty() || param_groups_[0].params().empty()
                          ? at::Tensor()
                          : param_groups_[0].params()[0];
  const c10::Device device =
      first.defined() && !first.is_meta() ? first.device() : c10::Device(c10::kCPU);
  comm_->raise_if_any_rank_failed(error, "construct its ZeroOptimizer", device);

  std::vector<std::vector<int64_t>> numels;
  for (const auto& group : param_groups_) {
    std::vector<int64_t> group_numels;
    for (const auto& param : group.params()) {
      group_numels.push_back(param.numel());
    }
    numels.push_back(std::move(group_numels));
  }
  layout_ =
      std::make_unique<PartitionLayout>(numels, comm_->world_size(), options_.reduce_bucket_size());
  check_layout_agrees_across_ranks();
  build_group_shards();
  std::vector<at::TensorOptions> grad_options;
  std::vector<std::vector<at::Tensor>> params;
  for (size_t g = 0; g < shards_.size(); ++g) {
    grad_options.push_back(shards_[g].flat_param.options());
    params.push_back(param_groups_[g].params());
  }
  buckets_ = std::make_unique<GradientBuckets>(
      *layout_, *comm_, std::move(grad_options),
      [this](size_t g) -> at::Tensor& { return shards_[g].grad_shard; },
      static_cast<size_t>(options_.max_buckets_in_flight()), options_.overlap_comm());
  if (options_.stage() >= 2) {
    hooks_ = std::make_unique<GradientHooks>(
        params, [this](size_t g, int64_t i, const at::Tensor& param) { on_gradient(g, i, param); },
        [this]() { on_backward_end(); });
  }
}

void ZeroOptimizer::validate_parameters() const {
  TORCH_CHECK_VALUE(!param_groups_.empty(), "ZeroOptimizer got no parameter groups");
  std::unordered_map<const void*, std::pair<size_t, size_t>> seen;
  c10::optional<c10::Device> device;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    TORCH_CHECK_VALUE(!params.empty(), "parameter group ", g, " has no parameters");
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& param = params[i];
      TORCH_CHECK_VALUE(param.defined(), "parameter ", i, " of group ", g,
                        " is an undefined tensor");
      TORCH_CHECK_VALUE(param.is_leaf(), "parameter ", i, " of group ", g,
                        " is not a leaf tensor (it was computed from other tensors); "
                        "can't optimize a non-leaf Tensor: pass the leaf parameters");
      TORCH_CHECK_VALUE(param.layout() == c10::kStrided, "parameter ", i, " of group ", g,
                        " has layout ", param.layout(),
                        "; zeroshard supports dense (strided) parameters only");
      TORCH_CHECK_VALUE(at::isFloatingType(param.scalar_type()), "parameter ", i, " of group ", g,
                        " has dtype ", param.scalar_type(),
                        "; zeroshard expects floating-point parameters");
      TORCH_CHECK_VALUE(param.scalar_type() == params[0].scalar_type(), "parameter ", i,
                        " of group ", g, " has dtype ", param.scalar_type(),
                        " but parameter 0 of the group has ", params[0].scalar_type(),
                        "; all parameters of a group must share one dtype");
      if (!device) {
        device = param.device();
      }
      TORCH_CHECK_VALUE(param.device() == *device, "parameter ", i, " of group ", g, " is on ",
                        param.device(), " but the first parameter is on ", *device,
                        "; all parameters must be on one device");
      auto [it, inserted] = seen.emplace(param.unsafeGetTensorImpl(), std::make_pair(g, i));
      TORCH_CHECK_VALUE(inserted, "some parameters appear more than once: parameter ", i,
                        " of group ", g, " is also parameter ", it->second.second, " of group ",
                        it->second.first, "; each parameter may belong to exactly one group, once");
    }
  }
}

void ZeroOptimizer::check_layout_agrees_across_ranks() {
  const int64_t fingerprint = layout_->fingerprint();
  at::Tensor extremes = at::tensor({fingerprint, -fingerprint}, at::kLong);
  extremes = extremes.to(param_groups_[0].params()[0].device());
  comm_->all_reduce_max(extremes, "layout_check");
  extremes = extremes.cpu();
  const int64_t max_fp = extremes[0].item<int64_t>();
  const int64_t min_fp = -extremes[1].item<int64_t>();
  TORCH_CHECK(max_fp == fingerprint && min_fp == fingerprint,
              "ranks built different partition layouts (this rank's fingerprint ", fingerprint,
              ", smallest ", min_fp, ", largest ", max_fp,
              "): every rank must pass the same parameters, with the same shapes, in the "
              "same groups and order, and the same reduce_bucket_size");
}

void ZeroOptimizer::build_group_shards() {
  const int64_t rank = comm_->rank();
  at::NoGradGuard no_grad;
  shards_.resize(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const GroupLayout& layout = layout_->group(g);
    auto& params = param_groups_[g].params();
    GroupShards& shard = shards_[g];
    const auto param_options = params[0].options().requires_grad(false);
    shard.flat_param = at::zeros({layout.flat_numel()}, param_options);
    for (size_t i = 0; i < params.size(); ++i) {
      const ParamSlot& slot = layout.slot_of_param(static_cast<int64_t>(i));
      shard.flat_param.narrow(0, slot.flat_offset, slot.numel)
          .copy_(params[i].detach().reshape({-1}));
    }
    comm_->broadcast(shard.flat_param, options_.broadcast_from_rank(),
                     "group" + std::to_string(g) + "/initial_params");
    // The model's parameters become views into the flat buffer, so the
    // all-gather after each step writes them with no extra copy.
    for (size_t i = 0; i < params.size(); ++i) {
      const ParamSlot& slot = layout.slot_of_param(static_cast<int64_t>(i));
      params[i].set_data(
          shard.flat_param.narrow(0, slot.flat_offset, slot.numel).view(params[i].sizes()));
    }
    if (params[0].scalar_type() != at::kFloat) {
      shard.master = at::empty({layout.shard_numel()}, fp32_options());
      for (const auto& bucket : layout.buckets()) {
        shard.master.narrow(0, bucket.shard_offset, bucket.shard_numel)
            .copy_(shard.flat_param.narrow(0, layout.rank_slice_offset(bucket, rank),
                                           bucket.shard_numel));
      }
    }
    if (options_.stage() >= 2) {
      // Stage 2 accumulates into the shard across backward passes; stage 1
      // allocates it only while a step runs.
      shard.grad_shard = at::zeros({layout.shard_numel()}, param_options);
    }
    shard.steps.assign(params.size(), 0);
    shard.segments = layout.segments_of_rank(rank);
    ensure_state_tensors(g);
  }
}

// [Note: fp32 master]
// Mixed-precision ZeRO keeps an fp32 master copy of each rank's shard. When
// the parameters already are fp32 that copy would duplicate values the rank
// holds anyway, so the master values are this rank's slices of the flat
// parameter buffer: the inner optimizer updates them in place and the
// all-gather sends them on. Adam's per-rank state is then 8 bytes per owned
// element instead of 12, the ZeRO paper's fp32 figure.
at::TensorOptions ZeroOptimizer::fp32_options() const {
  return shards_[0].flat_param.options().dtype(at::kFloat);
}

at::Tensor ZeroOptimizer::master_slice(size_t g, const Bucket& bucket) {
  GroupShards& shard = shards_[g];
  if (shard.master.defined()) {
    return shard.master.narrow(0, bucket.shard_offset, bucket.shard_numel);
  }
  return shard.flat_param.narrow(0, layout_->group(g).rank_slice_offset(bucket, comm_->rank()),
                                 bucket.shard_numel);
}

at::Tensor ZeroOptimizer::master_shard(size_t g) const {
  const GroupShards& shard = shards_[g];
  if (shard.master.defined()) {
    return shard.master.detach().clone();
  }
  const GroupLayout& layout = layout_->group(g);
  at::Tensor out = at::empty({layout.shard_numel()}, fp32_options());
  for (const auto& bucket : layout.buckets()) {
    out.narrow(0, bucket.shard_offset, bucket.shard_numel)
        .copy_(shard.flat_param.narrow(0, layout.rank_slice_offset(bucket, comm_->rank()),
                                       bucket.shard_numel));
  }
  return out;
}

void ZeroOptimizer::set_master_shard(size_t g, const at::Tensor& values) {
  for (const auto& bucket : layout_->group(g).buckets()) {
    master_slice(g, bucket).copy_(values.narrow(0, bucket.shard_offset, bucket.shard_numel));
  }
}

void ZeroOptimizer::ensure_state_tensors(size_t g) {
  GroupShards& shard = shards_[g];
  const auto options = fp32_options();
  const int64_t n = layout_->group(g).shard_numel();
  const auto& group_options = param_groups_[g].options();
  if (inner_kind_ == InnerOptimizerKind::kSGD) {
    if (optimizer_state_count(inner_kind_, group_options) > 0 && !shard.momentum_buffer.defined()) {
      shard.momentum_buffer = at::zeros({n}, options);
    }
    return;
  }
  if (!shard.exp_avg.defined()) {
    shard.exp_avg = at::zeros({n}, options);
    shard.exp_avg_sq = at::zeros({n}, options);
  }
  if (optimizer_state_count(inner_kind_, group_options) == 3 && !shard.max_exp_avg_sq.defined()) {
    shard.max_exp_avg_sq = at::zeros({n}, options);
  }
}

const at::Tensor& ZeroOptimizer::flat_parameters(size_t group) const {
  TORCH_CHECK_INDEX(group < shards_.size(), "group ", group, " out of range [0, ", shards_.size(),
                    ")");
  return shards_[group].flat_param;
}

int64_t ZeroOptimizer::optimizer_state_bytes() const {
  int64_t bytes = 0;
  for (const auto& shard : shards_) {
    for (const at::Tensor* t : {&shard.master, &shard.exp_avg, &shard.exp_avg_sq,
                                &shard.max_exp_avg_sq, &shard.momentum_buffer}) {
      if (t->defined()) {
        bytes += t->numel() * static_cast<int64_t>(t->element_size());
      }
    }
  }
  return bytes;
}

at::Tensor ZeroOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    // Hyper-parameters may have been edited since the last step (schedulers).
    validate_inner_options(inner_kind_, param_groups_[g].options());
    ensure_state_tensors(g);
  }
  finish_gradient_reduction();
  const auto has_grad = global_grad_presence();
  if (options_.max_norm() > 0) {
    clip_grad_norm(options_.max_norm());
  }
  update_shards(has_grad);
  gather_parameters();
  // The step consumes the gradients.
  std::lock_guard<std::mutex> lock(gradient_mutex_);
  clear_gradient_shards();
  return loss;
}

void ZeroOptimizer::zero_grad(bool set_to_none) {
  Optimizer::zero_grad(set_to_none);
  std::lock_guard<std::mutex> lock(gradient_mutex_);
  if (!buckets_->round_open()) {
    clear_gradient_shards();
  }
}

void ZeroOptimizer::clear_gradient_shards() {
  buckets_->wait_all();
  buckets_->reset();
  for (auto& shard : shards_) {
    if (options_.stage() >= 2) {
      shard.grad_shard.zero_();
    } else {
      shard.grad_shard = at::Tensor();
    }
  }
  gradients_reduced_ = false;
}

void ZeroOptimizer::on_gradient(size_t g, int64_t i, const at::Tensor& param) {
  if (!gradient_sync_) {
    return;  // no_sync: the gradient stays in .grad
  }
  std::lock_guard<std::mutex> lock(gradient_mutex_);
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) {
    return;
  }
  TORCH_CHECK_VALUE(grad.layout() == c10::kStrided, "parameter ", i, " of group ", g,
                    " has a sparse gradient; zeroshard does not support sparse "
                    "gradients (use a dense embedding: sparse=False)");
  at::NoGradGuard no_grad;
  if (comm_->event_log_enabled()) {  // no string building per gradient otherwise
    comm_->note("grad_ready", "group" + std::to_string(g) + "/param" + std::to_string(i));
  }
  buckets_->add_gradient(g, i, grad);
  gradients_reduced_ = false;
  // The full gradient now lives in the bucket; only the shard stays.
  grad.reset();
}

at::Tensor ZeroOptimizer::take_leftover_grad(size_t g, int64_t i) {
  at::Tensor& grad = param_groups_[g].params()[i].mutable_grad();
  at::Tensor taken = grad;
  grad.reset();
  return taken;
}

void ZeroOptimizer::on_backward_end() {
  if (!gradient_sync_) {
    return;
  }
  std::lock_guard<std::mutex> lock(gradient_mutex_);
  at::NoGradGuard no_grad;
  buckets_->flush([this](size_t g, int64_t i) { return take_leftover_grad(g, i); },
                  /*force_round=*/false);
  buckets_->wait_all();
}

void ZeroOptimizer::finish_gradient_reduction() {
  std::lock_guard<std::mutex> lock(gradient_mutex_);
  if (gradients_reduced_) {
    return;
  }
  at::NoGradGuard no_grad;
  if (options_.stage() == 1) {
    // Full gradients are in .grad; feed them in flat-buffer order so buckets
    // complete, and launch, one after another.
    clear_gradient_shards();
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      shards_[g].grad_shard =
          at::zeros({layout_->group(g).shard_numel()}, shards_[g].flat_param.options());
    }
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      const auto& params = param_groups_[g].params();
      for (const ParamSlot& slot : layout_->group(g).slots()) {
        const at::Tensor& grad = params[slot.param_index].grad();
        if (!grad.defined()) {
          continue;
        }
        TORCH_CHECK_VALUE(grad.layout() == c10::kStrided, "parameter ", slot.param_index,
                          " of group ", g,
                          " has a sparse gradient; zeroshard does not support sparse "
                          "gradients (use a dense embedding: sparse=False)");
        TORCH_CHECK_VALUE(grad.sizes() == params[slot.param_index].sizes(),
                          "gradient of parameter ", slot.param_index, " of group ", g,
                          " has shape ", grad.sizes(), " but the parameter has shape ",
                          params[slot.param_index].sizes());
        buckets_->add_gradient(g, slot.param_index, grad);
      }
    }
    buckets_->flush(nullptr, /*force_round=*/true);
  } else {
    // Gradients still in .grad (accumulated under no_sync) and buckets not yet
    // launched go now; a rank whose backward produced no gradient at all still
    // issues the round the other ranks issued.
    buckets_->flush([this](size_t g, int64_t i) { return take_leftover_grad(g, i); },
                    /*force_round=*/true);
  }
  buckets_->wait_all();
  for (auto& shard : shards_) {
    // Gloo has no AVG: sum, then divide.
    shard.grad_shard.div_(comm_->world_size());
  }
  gradients_reduced_ = true;
}

at::Tensor ZeroOptimizer::clip_grad_norm(double max_norm) {
  TORCH_CHECK_VALUE(max_norm > 0, "max_norm must be > 0, got ", max_norm);
  finish_gradient_reduction();
  at::NoGradGuard no_grad;
  at::Tensor squares = at::zeros({1}, fp32_options());
  for (const auto& shard : shards_) {
    squares.add_(shard.grad_shard.to(at::kFloat).pow(2).sum());
  }
  comm_->all_reduce_sum(squares, "grad_norm");
  at::Tensor total_norm = squares.sqrt().squeeze(0);
  // As torch.nn.utils.clip_grad_norm_ (Python's scalar / tensor is
  // reciprocal() * scalar), coefficient clamped at 1.
  at::Tensor coefficient = total_norm.add(1e-6).reciprocal().mul(max_norm).clamp_max(1.0);
  for (auto& shard : shards_) {
    shard.grad_shard.mul_(coefficient.to(shard.grad_shard.scalar_type()));
  }
  return total_norm;
}

int64_t ZeroOptimizer::gradient_bytes() const {
  int64_t bytes = buckets_->live_staging_bytes();
  for (size_t g = 0; g < shards_.size(); ++g) {
    const at::Tensor& shard = shards_[g].grad_shard;
    if (shard.defined()) {
      bytes += shard.numel() * static_cast<int64_t>(shard.element_size());
    }
    for (const auto& param : param_groups_[g].params()) {
      if (param.grad().defined()) {
        bytes += param.grad().numel() * static_cast<int64_t>(param.grad().element_size());
      }
    }
  }
  return bytes;
}

std::vector<std::vector<bool>> ZeroOptimizer::global_grad_presence() {
  int64_t total = 0;
  for (const auto& group : param_groups_) {
    total += static_cast<int64_t>(group.params().size());
  }
  at::Tensor flags = at::zeros({total}, at::kInt);
  auto* data = flags.data_ptr<int32_t>();
  int64_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i, ++index) {
      data[index] = buckets_->reported(g, static_cast<int64_t>(i)) ? 1 : 0;
    }
  }
  flags = flags.to(param_groups_[0].params()[0].device());
  comm_->all_reduce_max(flags, "grad_presence");
  flags = flags.cpu();
  data = flags.data_ptr<int32_t>();
  std::vector<std::vector<bool>> has_grad(param_groups_.size());
  index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i, ++index) {
      has_grad[g].push_back(data[index] != 0);
    }
  }
  return has_grad;
}

void ZeroOptimizer::update_shards(const std::vector<std::vector<bool>>& has_grad) {
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    GroupShards& shard = shards_[g];
    const auto& group_options = param_groups_[g].options();
    for (size_t i = 0; i < shard.steps.size(); ++i) {
      if (has_grad[g][i]) {
        shard.steps[i] += 1;
      }
    }
    at::Tensor grad32 = shard.grad_shard.scalar_type() == at::kFloat
                            ? shard.grad_shard
                            : shard.grad_shard.to(at::kFloat);
    // Contiguous runs of owned segments that share a step count and a bucket
    // are updated with one call each; with no skipped parameters that is one
    // call per bucket.
    const auto& segments = shard.segments;
    size_t begin = 0;
    while (begin < segments.size()) {
      const ShardSegment& first = segments[begin];
      if (!has_grad[g][first.param_index]) {
        ++begin;
        continue;
      }
      const int64_t step = shard.steps[first.param_index];
      size_t end = begin + 1;
      int64_t run_end = first.shard_offset + first.numel;
      while (end < segments.size() && has_grad[g][segments[end].param_index] &&
             shard.steps[segments[end].param_index] == step &&
             segments[end].bucket_index == first.bucket_index &&
             segments[end].shard_offset == run_end) {
        run_end += segments[end].numel;
        ++end;
      }
      const int64_t offset = first.shard_offset;
      const int64_t length = run_end - offset;
      auto slice = [&](const at::Tensor& t) {
        return t.defined() ? t.narrow(0, offset, length) : at::Tensor();
      };
      const Bucket& bucket = layout_->group(g).buckets()[first.bucket_index];
      at::Tensor master = master_slice(g, bucket).narrow(0, offset - bucket.shard_offset, length);
      ShardView view{master,
                     slice(grad32),
                     slice(shard.exp_avg),
                     slice(shard.exp_avg_sq),
                     slice(shard.max_exp_avg_sq),
                     slice(shard.momentum_buffer)};
      apply_inner_update(inner_kind_, group_options, view, step, options_.fused());
      begin = end;
    }
  }
}

void ZeroOptimizer::gather_parameters() {
  std::vector<PendingCollective> pending;
  std::vector<at::Tensor> inputs;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const GroupLayout& layout = layout_->group(g);
    GroupShards& shard = shards_[g];
    for (size_t b = 0; b < layout.buckets().size(); ++b) {
      const Bucket& bucket = layout.buckets()[b];
      // A copy even for fp32: the input must not alias the output.
      at::Tensor input = master_slice(g, bucket).to(shard.flat_param.scalar_type(),
                                                    /*non_blocking=*/false, /*copy=*/true);
      at::Tensor output = shard.flat_param.narrow(0, bucket.flat_offset, bucket.numel);
      pending.push_back(comm_->all_gather(output, input, bucket_tag(g, b)));
      inputs.push_back(std::move(input));
    }
  }
  for (auto& work : pending) {
    work.wait();
  }
}

}  // namespace zeroshard
