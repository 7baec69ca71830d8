#include "zeroshard/zero_optimizer.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cmath>
#include <unordered_map>

namespace zeroshard {

void validate_zero_options(const ZeroOptions& options, int64_t world_size) {
  TORCH_CHECK_VALUE(options.stage() >= 1 && options.stage() <= 3, "unsupported ZeRO stage ",
                    options.stage(),
                    "; zeroshard implements stage 1 (optimizer state sharding), stage 2 "
                    "(optimizer state and gradient sharding) and stage 3 (parameters too)");
  TORCH_CHECK_VALUE(options.stage3_prefetch_bucket_size() >= 0,
                    "stage3_prefetch_bucket_size must be >= 0 elements, got ",
                    options.stage3_prefetch_bucket_size());
  TORCH_CHECK_VALUE(options.stage3_param_persistence_threshold() >= 0,
                    "stage3_param_persistence_threshold must be >= 0 elements, got ",
                    options.stage3_param_persistence_threshold());
  TORCH_CHECK_VALUE(options.stage3_max_live_parameters() >= 0,
                    "stage3_max_live_parameters must be >= 0 elements, got ",
                    options.stage3_max_live_parameters());
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
    : ZeroOptimizer(param_groups, std::move(process_group), inner_defaults, options, {}) {}

ZeroOptimizer::ZeroOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                             const torch::optim::OptimizerOptions& inner_defaults,
                             ZeroOptions options, std::vector<ParameterUnit> units)
    : Optimizer(param_groups, inner_defaults.clone()),
      inner_kind_(inner_optimizer_kind_of(inner_defaults)),
      options_(options) {
  initialize(std::move(process_group), std::move(units));
}

ZeroOptimizer::~ZeroOptimizer() {
  alive_.reset();  // output hooks still registered on live tensors see it expire
  hooks_.reset();
  if (buckets_) {
    try {
      buckets_->wait_all();
    } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to report to in a destructor
    }
  }
}

ZeroOptimizer::ZeroOptimizer(std::vector<at::Tensor> params,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                             const torch::optim::OptimizerOptions& inner_defaults,
                             ZeroOptions options, std::vector<ParameterUnit> units)
    : ZeroOptimizer(
          std::vector<torch::optim::OptimizerParamGroup>{
              torch::optim::OptimizerParamGroup(std::move(params))},
          std::move(process_group), inner_defaults, options, std::move(units)) {}

void ZeroOptimizer::initialize(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                               std::vector<ParameterUnit> units) {
  TORCH_CHECK_VALUE(process_group, "ZeroOptimizer needs a process group; got a null one");
  comm_ = std::make_unique<Communicator>(std::move(process_group));
  comm_->set_reduce_scatter_all_to_all(options_.gloo_reduce_scatter_all_to_all());
  const auto& first = param_groups_.empty() || param_groups_[0].params().empty()
                          ? at::Tensor()
                          : param_groups_[0].params()[0];
  device_ = !first.defined()  ? c10::Device(c10::kCPU)
            : first.is_meta() ? options_.materialize_device()
                              : first.device();
  std::string error;
  std::vector<std::vector<int64_t>> param_units;
  std::vector<std::string> unit_names;
  std::vector<std::vector<at::Tensor>> unit_params;
  try {
    validate_zero_options(options_, comm_->world_size());
    for (auto& group : param_groups_) {
      validate_inner_options(inner_kind_, group.options());
    }
    TORCH_CHECK_VALUE(!options_.fused() || inner_kind_ != InnerOptimizerKind::kSGD,
                      "fused=True is available for Adam and AdamW, not SGD");
    TORCH_CHECK_VALUE(options_.stage() == 3 || units.empty(),
                      "units are a stage 3 feature; this optimizer has stage ", options_.stage());
    validate_parameters();
    index_parameters();
    if (options_.stage() == 3) {
      param_units = assign_units(units, unit_names, unit_params);
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  // Usually every rank passes the same arguments and fails alike; if only some
  // do, the others must not wait for them in the first collective.
  comm_->raise_if_any_rank_failed(error, "construct its ZeroOptimizer", device_);

  std::vector<std::vector<int64_t>> numels;
  for (const auto& group : param_groups_) {
    std::vector<int64_t> group_numels;
    for (const auto& param : group.params()) {
      group_numels.push_back(param.numel());
    }
    numels.push_back(std::move(group_numels));
  }
  layout_ = std::make_unique<PartitionLayout>(numels, comm_->world_size(),
                                              options_.reduce_bucket_size(), param_units);
  check_layout_agrees_across_ranks();
  std::vector<at::TensorOptions> param_options;
  for (const auto& group : param_groups_) {
    param_options.push_back(group.params()[0].options().device(device_).requires_grad(false));
  }
  if (options_.stage() == 3) {
    comm_->set_order_check_enabled(options_.check_collective_order());
    std::vector<std::vector<BucketId>> unit_buckets;
    for (const auto& params : unit_params) {
      // A unit whose parameters are all persistent gathers nothing (an empty
      // list means "every parameter" to buckets_of).
      unit_buckets.push_back(params.empty() ? std::vector<BucketId>{} : buckets_of(params));
    }
    gatherer_ = std::make_unique<ParameterGatherer>(
        *layout_, *comm_, param_options, std::move(unit_names), std::move(unit_buckets),
        [this](size_t g, size_t b) {
          const Bucket& bucket = layout_->group(g).buckets()[b];
          return shards_[g].param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel);
        },
        options_.stage3_prefetch_bucket_size(), options_.stage3_max_live_parameters());
  }
  shards_.resize(param_groups_.size());
  std::vector<at::TensorOptions> grad_options;
  for (size_t g = 0; g < shards_.size(); ++g) {
    shards_[g].param_options = param_options[g];
    shards_[g].grad_options =
        options_.reduce_in_fp32() ? param_options[g].dtype(at::kFloat) : param_options[g];
    grad_options.push_back(shards_[g].grad_options);
  }
  build_group_shards();
  GradientBuckets::BucketComplete on_complete;
  if (gatherer_) {
    on_complete = [this](size_t g, size_t b) { gatherer_->bucket_complete(g, b); };
  }
  buckets_ = std::make_unique<GradientBuckets>(
      *layout_, *comm_, grad_options,
      [this](size_t g) -> at::Tensor& { return shards_[g].grad_shard; },
      static_cast<size_t>(options_.max_buckets_in_flight()), options_.overlap_comm(),
      std::move(on_complete));
  set_bucket_expectations();
  bool waiting_for_adoption = false;
  for (const auto& group : replacements_) {
    for (const auto& replacement : group) {
      waiting_for_adoption = waiting_for_adoption || replacement.defined();
    }
  }
  if (uses_gradient_hooks() && !waiting_for_adoption) {
    install_gradient_hooks();
  }
}

// Frozen parameters (requires_grad false) never deliver a gradient; buckets
// must not wait for them, or every later bucket would wait for the end of
// backward (and, at stage 3, stay gathered).
void ZeroOptimizer::set_bucket_expectations() {
  std::vector<std::vector<bool>> expects(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (const auto& param : param_groups_[g].params()) {
      expects[g].push_back(param.requires_grad());
    }
  }
  buckets_->set_expects_gradient(std::move(expects));
}

void ZeroOptimizer::install_gradient_hooks() {
  std::vector<std::vector<at::Tensor>> params;
  for (const auto& group : param_groups_) {
    params.push_back(group.params());
  }
  hooks_ = std::make_unique<GradientHooks>(
      params, [this](size_t g, int64_t i, const at::Tensor& param) { on_gradient(g, i, param); },
      [this](bool outermost) { on_backward_end(outermost); });
}

std::vector<std::vector<int64_t>> ZeroOptimizer::assign_units(
    const std::vector<ParameterUnit>& units, std::vector<std::string>& unit_names,
    std::vector<std::vector<at::Tensor>>& unit_params) {
  const auto& index_of = param_index_;
  std::vector<std::vector<int64_t>> param_units(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    param_units[g].assign(param_groups_[g].params().size(), kNoUnit);
  }
  for (size_t u = 0; u < units.size(); ++u) {
    const ParameterUnit& unit = units[u];
    TORCH_CHECK_VALUE(
        std::find(unit_names.begin(), unit_names.end(), unit.name) == unit_names.end(),
        "two units are named '", unit.name, "'; unit names must be unique");
    std::vector<at::Tensor> kept;
    for (size_t p = 0; p < unit.params.size(); ++p) {
      const auto found = index_of.find(unit.params[p].unsafeGetTensorImpl());
      TORCH_CHECK_VALUE(found != index_of.end(), "parameter ", p, " of unit '", unit.name,
                        "' is not one of the optimizer's parameters; pass every parameter of "
                        "the units to the optimizer");
      const auto [g, i] = found->second;
      const int64_t numel = param_groups_[g].params()[i].numel();
      if (numel < options_.stage3_param_persistence_threshold()) {
        continue;  // persistent: stays gathered, belongs to no unit
      }
      if (param_units[g][i] == kNoUnit) {
        param_units[g][i] = static_cast<int64_t>(u);
      }
      kept.push_back(unit.params[p]);
    }
    unit_names.push_back(unit.name);
    unit_params.push_back(std::move(kept));
  }
  return param_units;
}

void ZeroOptimizer::index_parameters() {
  param_index_.clear();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      param_index_.emplace(params[i].unsafeGetTensorImpl(), std::make_pair(g, i));
    }
  }
}

std::vector<BucketId> ZeroOptimizer::buckets_of(const std::vector<at::Tensor>& params) const {
  std::vector<BucketId> buckets;
  auto add = [&](size_t g, size_t i) {
    const ParamSlot& slot = layout_->group(g).slot_of_param(static_cast<int64_t>(i));
    if (slot.numel == 0) {
      return;
    }
    const BucketId id{g, static_cast<size_t>(slot.bucket_index)};
    if (std::find(buckets.begin(), buckets.end(), id) == buckets.end()) {
      buckets.push_back(id);
    }
  };
  if (params.empty()) {
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
        add(g, i);
      }
    }
    return buckets;
  }
  const auto& index_of = param_index_;
  for (size_t p = 0; p < params.size(); ++p) {
    const auto found = index_of.find(params[p].unsafeGetTensorImpl());
    TORCH_CHECK_VALUE(found != index_of.end(), "tensor ", p,
                      " is not one of this optimizer's parameters");
    add(found->second.first, found->second.second);
  }
  return buckets;
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
      TORCH_CHECK_VALUE(param.is_meta() == param_groups_[0].params()[0].is_meta(), "parameter ", i,
                        " of group ", g,
                        " is on the meta device and others are not (or the reverse); build the "
                        "whole model on the meta device for partitioned construction");
      TORCH_CHECK_VALUE(!param.is_meta() || options_.stage() == 3, "parameter ", i, " of group ", g,
                        " is on the meta device; only stage 3 materializes meta parameters "
                        "(partitioned construction). Materialize the model or use stage=3");
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
  extremes = extremes.to(device());
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
  replacements_.assign(param_groups_.size(), {});
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const GroupLayout& layout = layout_->group(g);
    auto& params = param_groups_[g].params();
    GroupShards& shard = shards_[g];
    const auto param_options = shard.param_options;
    shard.steps.assign(params.size(), 0);
    shard.segments = layout.segments_of_rank(rank);
    if (options_.stage() == 3) {
      build_stage3_shards(g);
      ensure_state_tensors(g);
      continue;
    }
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
      shard.grad_shard = at::zeros({layout.shard_numel()}, shard.grad_options);
    }
    ensure_state_tensors(g);
  }
}

// Stage 3: each bucket is assembled in its full buffer once (from the
// parameters, or zeros for meta parameters), this rank keeps its slice in
// param_shard, the parameters become views of the buffer, and the buffer's
// storage is freed unless the bucket is persistent.
void ZeroOptimizer::build_stage3_shards(size_t g) {
  const int64_t rank = comm_->rank();
  const GroupLayout& layout = layout_->group(g);
  auto& params = param_groups_[g].params();
  GroupShards& shard = shards_[g];
  const bool meta = params[0].is_meta();
  shard.param_shard = at::zeros({layout.shard_numel()}, shard.param_options);
  shard.grad_shard = at::zeros({layout.shard_numel()}, shard.grad_options);
  replacements_[g].assign(params.size(), at::Tensor());
  for (size_t b = 0; b < layout.buckets().size(); ++b) {
    const Bucket& bucket = layout.buckets()[b];
    gatherer_->ensure_allocated(g, b);
    at::Tensor& full = gatherer_->full(g, b);
    full.zero_();
    if (!meta) {
      for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
        const ParamSlot& slot = layout.slots()[s];
        full.narrow(0, slot.flat_offset - bucket.flat_offset, slot.numel)
            .copy_(params[slot.param_index].detach().reshape({-1}));
      }
      comm_->broadcast(full, options_.broadcast_from_rank(),
                       "group" + std::to_string(g) + "/initial_params");
      gatherer_->mark_initialized(g, b);
    }
    shard.param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel)
        .copy_(full.narrow(0, rank * bucket.shard_numel, bucket.shard_numel));
    for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
      const ParamSlot& slot = layout.slots()[s];
      at::Tensor& param = params[slot.param_index];
      at::Tensor view =
          full.narrow(0, slot.flat_offset - bucket.flat_offset, slot.numel).view(param.sizes());
      if (meta) {
        // A tensor of its own whose data is the view: views share their
        // base's version counter, and the gathers write the base in place,
        // which autograd would take for an edit of a saved parameter.
        at::Tensor replacement = at::empty({0}, shard.param_options);
        replacement.set_data(view);
        replacements_[g][slot.param_index] = replacement;
      } else {
        param.set_data(view);
      }
    }
    gatherer_->release(g, b);  // no-op for persistent buckets
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) {  // in no bucket
      at::Tensor empty = at::empty(params[i].sizes(), shard.param_options);
      if (meta) {
        replacements_[g][i] = empty;
      } else {
        params[i].set_data(empty);
      }
    }
  }
  if (shard.param_options.dtype() != at::kFloat) {
    shard.master = shard.param_shard.to(at::kFloat);
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
  return shards_[0].param_options.dtype(at::kFloat);
}

at::Tensor ZeroOptimizer::master_slice(size_t g, const Bucket& bucket) {
  GroupShards& shard = shards_[g];
  if (shard.master.defined()) {
    return shard.master.narrow(0, bucket.shard_offset, bucket.shard_numel);
  }
  if (shard.param_shard.defined()) {  // stage 3, fp32
    return shard.param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel);
  }
  return shard.flat_param.narrow(0, layout_->group(g).rank_slice_offset(bucket, comm_->rank()),
                                 bucket.shard_numel);
}

at::Tensor ZeroOptimizer::master_shard(size_t g) const {
  const GroupShards& shard = shards_[g];
  if (shard.master.defined()) {
    return shard.master.detach().clone();
  }
  if (shard.param_shard.defined()) {  // stage 3, fp32
    return shard.param_shard.detach().clone();
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
  TORCH_CHECK(options_.stage() < 3,
              "flat_parameters() is a stage 1/2 view; at stage 3 parameters are gathered per "
              "unit (use full_parameters() or pin_parameters())");
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
  bool overflow = false;
  const auto has_grad = global_grad_presence(&overflow);
  last_step_skipped_ = overflow;
  if (overflow) {
    // Every rank saw the flag: nothing is updated anywhere.
    skipped_steps_ += 1;
    if (gatherer_) {
      gatherer_->after_step();
    }
  } else {
    if (options_.max_norm() > 0) {
      clip_grad_norm(options_.max_norm());
    }
    update_shards(has_grad);
    gather_parameters();
  }
  comm_->set_step(comm_->step() + 1);
  // The step consumes the gradients.
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  clear_gradient_shards();
  return loss;
}

void ZeroOptimizer::zero_grad(bool set_to_none) {
  Optimizer::zero_grad(set_to_none);
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  if (buckets_->round_open()) {
    // Only a backward pass that failed midway (an exception, e.g. out of
    // memory) leaves a round open here: its end-of-backward never ran.
    buckets_->abandon_round();
    if (hooks_) {
      hooks_->forget_backwards();
    }
    if (gatherer_) {
      gatherer_->backward_finished();
    }
  }
  clear_gradient_shards();
  unsynced_gradients_ = false;
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
  stage1_stale_ = false;
  stage1_copied_.clear();
}

void ZeroOptimizer::on_gradient(size_t g, int64_t i, const at::Tensor& param) {
  if (!gradient_sync_) {
    unsynced_gradients_ = true;
    return;  // no_sync: the gradient stays in .grad
  }
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) {
    return;
  }
  TORCH_CHECK_VALUE(grad.layout() == c10::kStrided, "parameter ", i, " of group ", g,
                    " has a sparse gradient; zeroshard does not support sparse "
                    "gradients (use a dense embedding: sparse=False)");
  at::NoGradGuard no_grad;
  if (options_.stage() == 1) {
    on_stage1_gradient(g, i, grad);
    return;
  }
  if (comm_->event_log_enabled()) {  // no string building per gradient otherwise
    comm_->note("grad_ready", "group" + std::to_string(g) + "/param" + std::to_string(i));
  }
  buckets_->add_gradient(g, i, grad);
  gradients_reduced_ = false;
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
void ZeroOptimizer::on_stage1_gradient(size_t g, int64_t i, const at::Tensor& grad) {
  if (stage1_stale_) {
    return;
  }
  if (buckets_->reported(g, i) || (!buckets_->round_open() && buckets_->rounds_since_reset() > 0)) {
    stage1_stale_ = true;  // a second backward since the last step
    return;
  }
  ensure_stage1_grad_shards();
  if (comm_->event_log_enabled()) {
    comm_->note("grad_ready", "group" + std::to_string(g) + "/param" + std::to_string(i));
  }
  stage1_copied_.push_back(Stage1Copy{g, i, grad, grad._version()});
  buckets_->add_gradient(g, i, grad);
  gradients_reduced_ = false;
}

void ZeroOptimizer::ensure_stage1_grad_shards() {
  for (size_t g = 0; g < shards_.size(); ++g) {
    if (!shards_[g].grad_shard.defined()) {
      shards_[g].grad_shard = at::zeros({layout_->group(g).shard_numel()}, shards_[g].grad_options);
    }
  }
}

bool ZeroOptimizer::stage1_copies_current() {
  bool current = !stage1_stale_;
  if (current) {
    size_t with_grad = 0;
    for (const auto& group : param_groups_) {
      for (const auto& param : group.params()) {
        with_grad += param.grad().defined() ? 1 : 0;
      }
    }
    // A .grad set where no hook fired, replaced, or changed in place.
    current = with_grad == stage1_copied_.size();
    for (const Stage1Copy& copy : stage1_copied_) {
      const at::Tensor& now = param_groups_[copy.group].params()[copy.index].grad();
      current = current && now.is_same(copy.grad) && now._version() == copy.version;
    }
  }
  at::Tensor stale = at::tensor({current ? 0 : 1}, at::kInt).to(device());
  comm_->all_reduce_max(stale, "stage1_overlap_check");
  return stale.cpu().item<int32_t>() == 0;
}

at::Tensor ZeroOptimizer::take_leftover_grad(size_t g, int64_t i) {
  at::Tensor& grad = param_groups_[g].params()[i].mutable_grad();
  at::Tensor taken = grad;
  grad.reset();
  return taken;
}

void ZeroOptimizer::on_backward_end(bool outermost) {
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::NoGradGuard no_grad;
  if (gradient_sync_ && !(options_.stage() == 1 && stage1_stale_)) {
    // Stage 1 keeps .grad; stages 2 and 3 move what is left into the buckets.
    buckets_->flush(
        [this](size_t g, int64_t i) {
          return options_.stage() == 1 ? param_groups_[g].params()[i].grad()
                                       : take_leftover_grad(g, i);
        },
        /*force_round=*/false);
    buckets_->wait_all();
  }
  // An inner (reentrant checkpoint) backward must not release what the
  // outer backward still needs.
  if (gatherer_ && outermost) {
    gatherer_->backward_finished();
  }
}

void ZeroOptimizer::finish_gradient_reduction() {
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  if (gradients_reduced_) {
    return;
  }
  at::NoGradGuard no_grad;
  bool reduced_in_backward = false;
  if (options_.stage() == 1 && hooks_) {
    // A rank whose backward delivered no gradient issues the round the others
    // issued during backward now, before the check that every rank makes.
    ensure_stage1_grad_shards();
    buckets_->flush([this](size_t g, int64_t i) { return param_groups_[g].params()[i].grad(); },
                    /*force_round=*/true);
    buckets_->wait_all();
    reduced_in_backward = stage1_copies_current();
  }
  if (reduced_in_backward) {
    // The hooks reduced during backward (see [Note: stage 1 overlap]).
  } else if (options_.stage() == 1) {
    // Full gradients are in .grad; feed them in flat-buffer order so buckets
    // complete, and launch, one after another.
    clear_gradient_shards();
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      shards_[g].grad_shard = at::zeros({layout_->group(g).shard_numel()}, shards_[g].grad_options);
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
  for (auto& shard : shards_) {
    // Gloo has no AVG: sum, then divide; and undo the loss scale.
    shard.grad_shard.div_(static_cast<double>(comm_->world_size()) * loss_scale_);
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

void ZeroOptimizer::set_loss_scale(double scale) {
  TORCH_CHECK_VALUE(scale > 0 && std::isfinite(scale), "loss scale must be finite and > 0, got ",
                    scale);
  loss_scale_ = scale;
}

std::vector<std::vector<bool>> ZeroOptimizer::global_grad_presence(bool* overflow) {
  int64_t total = 0;
  for (const auto& group : param_groups_) {
    total += static_cast<int64_t>(group.params().size());
  }
  // The last flag: this rank's reduced gradients hold inf/NaN.
  at::Tensor flags = at::zeros({total + 1}, at::kInt);
  if (options_.skip_nonfinite_steps()) {
    bool finite = true;
    for (const auto& shard : shards_) {
      finite = finite && at::isfinite(shard.grad_shard).all().item<bool>();
    }
    flags[total] = finite ? 0 : 1;
  }
  auto* data = flags.data_ptr<int32_t>();
  int64_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i, ++index) {
      data[index] = buckets_->reported(g, static_cast<int64_t>(i)) ? 1 : 0;
    }
  }
  flags = flags.to(device());
  comm_->all_reduce_max(flags, "grad_presence");
  flags = flags.cpu();
  data = flags.data_ptr<int32_t>();
  *overflow = data[total] != 0;
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
  if (gatherer_) {
    for (auto& shard : shards_) {
      if (shard.master.defined()) {  // 16-bit parameters: send the rounded master
        shard.param_shard.copy_(shard.master);
      }
    }
    gatherer_->after_step();
    return;
  }
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

namespace zeroshard {

std::vector<std::vector<at::Tensor>> ZeroOptimizer::full_parameters(int64_t rank) {
  TORCH_CHECK_VALUE(rank >= 0 && rank < comm_->world_size(), "rank must be in [0, ",
                    comm_->world_size(), "), got ", rank);
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::NoGradGuard no_grad;
  std::vector<std::vector<at::Tensor>> out(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const GroupLayout& layout = layout_->group(g);
    const auto& params = param_groups_[g].params();
    if (comm_->rank() == rank) {
      for (const auto& param : params) {
        out[g].push_back(at::zeros(param.sizes(), fp32_options()));
      }
    }
    for (size_t b = 0; b < layout.buckets().size(); ++b) {
      const Bucket& bucket = layout.buckets()[b];
      at::Tensor input = master_slice(g, bucket).to(at::kFloat, /*non_blocking=*/false,
                                                    /*copy=*/true);
      at::Tensor full = at::empty({bucket.numel}, fp32_options());
      comm_->all_gather(full, input, "full_parameters/" + bucket_tag(g, b)).wait();
      if (comm_->rank() != rank) {
        continue;
      }
      for (int64_t s = bucket.first_slot; s < bucket.end_slot; ++s) {
        const ParamSlot& slot = layout.slots()[s];
        out[g][slot.param_index].view({-1}).copy_(
            full.narrow(0, slot.flat_offset - bucket.flat_offset, slot.numel));
      }
    }
  }
  return out;
}

int64_t ZeroOptimizer::num_units() const { return gatherer_ ? gatherer_->num_units() : 0; }

int64_t ZeroOptimizer::unit_index(const std::string& name) const {
  for (int64_t u = 0; u < num_units(); ++u) {
    if (gatherer_->unit_name(u) == name) {
      return u;
    }
  }
  TORCH_CHECK_INDEX(false, "no unit named '", name, "'");
}

void ZeroOptimizer::unit_pre_forward(int64_t unit) {
  TORCH_CHECK(gatherer_, "unit hooks need stage 3");
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::NoGradGuard no_grad;
  // A forward inside a backward pass is an activation-checkpoint recompute.
  const bool in_backward = torch::autograd::get_current_graph_task_id() != -1;
  if (in_backward && hooks_) {
    hooks_->track_current_backward();
  }
  gatherer_->pre_forward(unit, in_backward);
}

void ZeroOptimizer::unit_post_forward(int64_t unit) {
  TORCH_CHECK(gatherer_, "unit hooks need stage 3");
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  gatherer_->post_forward(unit, torch::autograd::get_current_graph_task_id() != -1);
}

void ZeroOptimizer::unit_track_output(int64_t unit, const at::Tensor& output) {
  TORCH_CHECK(gatherer_, "unit hooks need stage 3");
  if (!output.defined() || !output.requires_grad() || !at::GradMode::is_enabled()) {
    return;
  }
  std::weak_ptr<bool> alive = alive_;
  // Registering on a tensor that autograd already finished with is harmless:
  // the hook never fires.
  output.register_hook([this, alive, unit](const at::Tensor&) {
    if (alive.expired()) {
      return;
    }
    std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
    at::NoGradGuard no_grad;
    if (hooks_) {
      hooks_->track_current_backward();
    }
    gatherer_->pre_backward(unit);
  });
}

void ZeroOptimizer::pin_parameters(const std::vector<at::Tensor>& params) {
  if (!gatherer_) {
    return;  // stages 1 and 2: always gathered
  }
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::NoGradGuard no_grad;
  gatherer_->pin(buckets_of(params));
}

void ZeroOptimizer::unpin_parameters(const std::vector<at::Tensor>& params, int64_t modifier_rank) {
  TORCH_CHECK_VALUE(modifier_rank < comm_->world_size(), "modifier_rank must be < world size ",
                    comm_->world_size(), ", got ", modifier_rank);
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::NoGradGuard no_grad;
  const std::vector<BucketId> buckets = buckets_of(params);
  if (modifier_rank >= 0) {
    for (const auto& [g, b] : buckets) {
      const Bucket& bucket = layout_->group(g).buckets()[b];
      at::Tensor full = gatherer_
                            ? gatherer_->full(g, b)
                            : shards_[g].flat_param.narrow(0, bucket.flat_offset, bucket.numel);
      comm_->broadcast(full, modifier_rank, "modified/" + bucket_tag(g, b));
      at::Tensor mine = full.narrow(0, comm_->rank() * bucket.shard_numel, bucket.shard_numel);
      master_slice(g, bucket).copy_(mine);
      if (shards_[g].param_shard.defined()) {
        shards_[g].param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel).copy_(mine);
      }
    }
  }
  if (gatherer_) {
    gatherer_->unpin(buckets);
  }
}

void ZeroOptimizer::adopt_parameters(const std::vector<std::vector<at::Tensor>>& params) {
  TORCH_CHECK_VALUE(params.size() == param_groups_.size(), "adopt_parameters: expected ",
                    param_groups_.size(), " groups, got ", params.size());
  for (size_t g = 0; g < params.size(); ++g) {
    auto& current = param_groups_[g].params();
    TORCH_CHECK_VALUE(params[g].size() == current.size(), "adopt_parameters: group ", g, " has ",
                      current.size(), " parameters, got ", params[g].size());
    for (size_t i = 0; i < current.size(); ++i) {
      const at::Tensor& replacement = replacements_.at(g).at(i);
      const at::Tensor& given = params[g][i];
      TORCH_CHECK_VALUE(given.defined() && given.sizes() == current[i].sizes(),
                        "adopt_parameters: parameter ", i, " of group ", g, " must keep its shape ",
                        current[i].sizes());
      TORCH_CHECK_VALUE(
          replacement.defined() ? given.is_alias_of(replacement) : given.is_same(current[i]),
          "adopt_parameters: parameter ", i, " of group ", g,
          " must be replacement_parameters()[g][i] wrapped (e.g. "
          "torch.nn.Parameter(replacement), not a copy), or the parameter itself "
          "where there is no replacement");
    }
  }
  // Everything checked: commit.
  for (size_t g = 0; g < params.size(); ++g) {
    param_groups_[g].params() = params[g];
    replacements_[g].assign(params[g].size(), at::Tensor());
  }
  index_parameters();
  set_bucket_expectations();
  if (uses_gradient_hooks()) {
    install_gradient_hooks();
  }
}

void ZeroOptimizer::begin_initialization(const std::vector<at::Tensor>& params) {
  TORCH_CHECK(gatherer_, "begin_initialization is for stage 3 partitioned construction");
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::NoGradGuard no_grad;
  gatherer_->pin_for_initialization(buckets_of(params));
}

void ZeroOptimizer::end_initialization(const std::vector<at::Tensor>& params) {
  TORCH_CHECK(gatherer_, "end_initialization is for stage 3 partitioned construction");
  std::lock_guard<std::recursive_mutex> lock(gradient_mutex_);
  at::NoGradGuard no_grad;
  const std::vector<BucketId> buckets = buckets_of(params);
  for (const auto& [g, b] : buckets) {
    const Bucket& bucket = layout_->group(g).buckets()[b];
    at::Tensor mine =
        gatherer_->full(g, b).narrow(0, comm_->rank() * bucket.shard_numel, bucket.shard_numel);
    shards_[g].param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel).copy_(mine);
    if (shards_[g].master.defined()) {
      shards_[g].master.narrow(0, bucket.shard_offset, bucket.shard_numel).copy_(mine);
    }
  }
  gatherer_->unpin(buckets);
}

int64_t ZeroOptimizer::parameter_bytes() const {
  int64_t bytes = gathered_parameter_bytes();
  for (const auto& shard : shards_) {
    if (shard.param_shard.defined()) {
      bytes += shard.param_shard.numel() * static_cast<int64_t>(shard.param_shard.element_size());
    }
  }
  return bytes;
}

int64_t ZeroOptimizer::gathered_parameter_bytes() const {
  if (gatherer_) {
    return gatherer_->live_bytes();
  }
  int64_t bytes = 0;
  for (const auto& shard : shards_) {
    bytes += shard.flat_param.numel() * static_cast<int64_t>(shard.flat_param.element_size());
  }
  return bytes;
}

int64_t ZeroOptimizer::peak_gathered_parameter_bytes() const {
  return gatherer_ ? gatherer_->peak_live_bytes() : gathered_parameter_bytes();
}

void ZeroOptimizer::reset_peak_gathered_parameter_bytes() {
  if (gatherer_) {
    gatherer_->reset_peak_live_bytes();
  }
}

}  // namespace zeroshard
