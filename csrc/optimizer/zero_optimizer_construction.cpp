// Construction: validation, the partition layout, the shards, the buckets,
// the hooks and (stage 3) the gatherer; the bookkeeping of parameters.
#include "zero_optimizer_impl.h"

#include "zeroshard/update_rule.h"

#include "../checkpoint/checkpoint_detail.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <unordered_map>

namespace zeroshard {

ZeroOptimizer::Impl::Impl(ZeroOptimizer& owner,
                          const torch::optim::OptimizerOptions& inner_defaults, ZeroOptions options,
                          c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                          c10::intrusive_ptr<c10d::ProcessGroup> replicate_group,
                          std::vector<ParameterUnit> units)
    : owner_(owner),
      param_groups_(owner.param_groups_),
      inner_kind_(inner_optimizer_kind_of(inner_defaults)),
      options_(options) {
  initialize(std::move(process_group), std::move(replicate_group), std::move(units));
}

ZeroOptimizer::Impl::~Impl() {
  async_saver_.finish_quietly();  // exit waits for an asynchronous save
  alive_.reset();                 // output hooks still registered on live tensors see it expire
  gradients_.reset();             // its hooks first, then the reductions in flight
}

void ZeroOptimizer::Impl::initialize(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                     c10::intrusive_ptr<c10d::ProcessGroup> replicate_group,
                                     std::vector<ParameterUnit> units) {
  TORCH_CHECK_VALUE(process_group, "ZeroOptimizer needs a process group; got a null one");
  TORCH_CHECK_VALUE(!replicate_group || replicate_group.get() != process_group.get(),
                    "replicate_group is the shard group itself; hybrid sharding needs the "
                    "group of ranks holding the same shard in the other shard groups");
  const auto& first = param_groups_.empty() || param_groups_[0].params().empty()
                          ? at::Tensor()
                          : param_groups_[0].params()[0];
  device_ = !first.defined()  ? c10::Device(c10::kCPU)
            : first.is_meta() ? options_.materialize_device()
                              : first.device();
  groups_ = std::make_unique<ProcessGroups>(make_communicator(std::move(process_group)),
                                            replicate_group && replicate_group->getSize() > 1
                                                ? make_communicator(std::move(replicate_group))
                                                : nullptr);
  std::string error;
  std::vector<std::vector<int64_t>> param_units;
  std::vector<std::string> unit_names;
  std::vector<std::vector<at::Tensor>> unit_params;
  try {
    validate_zero_options(options_, groups_->shard().world_size());
    for (auto& group : param_groups_) {
      validate_inner_options(inner_kind_, group.options());
    }
    check_rule_parameters();
    TORCH_CHECK_VALUE(!options_.fused() || inner_kind_ == InnerOptimizerKind::kAdam ||
                          inner_kind_ == InnerOptimizerKind::kAdamW,
                      "fused=True is available for Adam and AdamW, not ", rule_name());
    TORCH_CHECK_VALUE(inner_kind_ != InnerOptimizerKind::kRule ||
                          options_.offload_optimizer().device() != OffloadDevice::kNVMe,
                      "offload_optimizer with device 'nvme' swaps the states of Adam, AdamW "
                      "and SGD; the update rule ",
                      rule_name(),
                      " keeps its states on the host with device 'cpu', or use optimizer "
                      "'adam', 'adamw' or 'sgd'");
    TORCH_CHECK_VALUE(options_.stage() == 3 || units.empty(),
                      "units are a stage 3 feature; this optimizer has stage ", options_.stage());
    validate_parameters();
    param_index_.rebuild(param_groups_);
    if (options_.stage() == 3) {
      param_units = assign_units(units, unit_names, unit_params);
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  // Usually every rank passes the same arguments and fails alike; if only some
  // do, the others must not wait for them in the first collective.
  groups_->raise_if_any_failed(error, "construct its ZeroOptimizer", "construction");
  if (groups_->replica()) {
    // Replicas must hold the same shard: the same position in shard groups
    // of one size (a replicate group built from other ranks would sum
    // gradient shards of different elements).
    const int64_t rank = groups_->shard().rank();
    const int64_t size = groups_->shard().world_size();
    at::Tensor extremes = at::tensor({rank, -rank, size, -size}, at::kLong);
    groups_->max_across_replicas(extremes, "position");
    const auto* e = extremes.data_ptr<int64_t>();
    std::string mismatch;
    if (e[0] != rank || -e[1] != rank || e[2] != size || -e[3] != size) {
      mismatch =
          "replicate_group must hold one rank per shard group, each at the same "
          "position in shard groups of one size; this rank is rank " +
          std::to_string(rank) + " of a shard group of " + std::to_string(size) +
          ", its replicate group spans shard ranks " + std::to_string(-e[1]) + ".." +
          std::to_string(e[0]) + " and shard group sizes " + std::to_string(-e[3]) + ".." +
          std::to_string(e[2]);
    }
    groups_->raise_if_any_failed(mismatch, "check its replicate group", "replicate_group");
  }

  std::vector<std::vector<int64_t>> numels;
  std::vector<int64_t> alignments;         // [Note: aligned slots], in each group's dtype
  std::vector<bool> whole;                 // [Note: whole parameters]
  std::vector<std::vector<double>> costs;  // and who owns which
  for (const auto& group : param_groups_) {
    const auto* rule = inner_kind_ == InnerOptimizerKind::kRule
                           ? &static_cast<const RuleOptions&>(group.options())
                           : nullptr;
    whole.push_back(rule != nullptr && rule->rule()->whole_parameters(rule->hyperparameters()));
    std::vector<int64_t> group_numels;
    std::vector<double> group_costs;
    for (const auto& param : group.params()) {
      group_numels.push_back(param.numel());
      if (whole.back()) {
        group_costs.push_back(
            rule->rule()->update_cost(param.sizes().vec(), rule->hyperparameters()));
      }
    }
    numels.push_back(std::move(group_numels));
    costs.push_back(std::move(group_costs));
    alignments.push_back(
        group.params().empty() ? 1 : alignment_in_elements(group.params()[0].element_size()));
  }
  layout_ = std::make_unique<PartitionLayout>(numels, groups_->shard().world_size(),
                                              options_.reduce_bucket_size(), param_units,
                                              alignments, whole, costs);
  check_layout_agrees_across_ranks();
  std::vector<int64_t> shard_numels;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    shard_numels.push_back(layout_->group(g).shard_numel());
  }
  placement_ = std::make_unique<StatePlacement>(
      shard_numels, options_.sub_group_size(), options_.offload_optimizer(),
      options_.offload_param(), device_,
      std::vector<bool>(param_groups_.size(), inner_kind_ == InnerOptimizerKind::kRule));
  std::vector<at::TensorOptions> param_options;
  for (const auto& group : param_groups_) {
    param_options.push_back(group.params()[0].options().device(device_).requires_grad(false));
  }
  if (options_.stage() == 3) {
    groups_->shard().set_order_check_enabled(options_.check_collective_order());
    std::vector<std::vector<BucketId>> unit_buckets;
    for (const auto& params : unit_params) {
      // A unit whose parameters are all persistent gathers nothing (an empty
      // list means "every parameter" to buckets_of).
      unit_buckets.push_back(params.empty() ? std::vector<BucketId>{} : buckets_of(params));
    }
    gatherer_ = std::make_unique<ParameterGatherer>(
        *layout_, groups_->shard(), param_options, std::move(unit_names), std::move(unit_buckets),
        Stage3ShardSource(*layout_, *placement_, buffers_, param_swapper_, host_syncs_),
        options_.stage3_prefetch_bucket_size(), options_.stage3_max_live_parameters());
    stage3_events_ = std::make_unique<GathererGradientEvents>(*gatherer_);
  }
  buffers_.resize(param_groups_.size());
  std::vector<std::vector<std::vector<int64_t>>> shapes(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (const auto& param : param_groups_[g].params()) {
      shapes[g].push_back(param.sizes().vec());
    }
  }
  device_storage_ = std::make_unique<DeviceShardStorage>(
      buffers_, *layout_, groups_->shard().rank(), device_, inner_kind_, std::move(shapes));
  parameter_gathers_ = BucketGathers(param_groups_.size());
  for (size_t g = 0; g < buffers_.size(); ++g) {
    buffers_[g].param_options = param_options[g];
  }
  if (placement_->offloads_optimizer()) {
    std::vector<c10::ScalarType> dtypes;
    for (const auto& options : param_options) {
      dtypes.push_back(c10::typeMetaToScalarType(options.dtype()));
    }
    int64_t nvme_states = 0;  // the master plus the most moments a group needs
    for (const auto& group : param_groups_) {
      nvme_states = std::max(nvme_states, 1 + optimizer_state_count(inner_kind_, group.options()));
    }
    // A rank that cannot reserve its swap space (path, permissions, free
    // space) fails here; every rank raises its message instead of hanging.
    std::string error;
    std::exception_ptr failure;
    try {
      offloaded_ = std::make_unique<OffloadedOptimizerState>(
          *placement_, inner_kind_, dtypes, groups_->shard().rank(), options_.aio(), nvme_states);
      offloaded_->set_host_sync_counter(&host_syncs_);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
      failure = std::current_exception();
    } catch (const std::exception& e) {
      error = e.what();
      failure = std::current_exception();
    }
    if (placement_->offload_tier() == StateTier::kNVMe) {
      const std::string agreed = groups_->agree(error, "nvme_setup");
      TORCH_CHECK(agreed.empty(), "could not set up the NVMe swap space: ", agreed);
    } else if (failure) {
      std::rethrow_exception(failure);
    }
  }
  if (placement_->parameter_tier() == StateTier::kNVMe) {
    std::vector<c10::ScalarType> dtypes;
    for (const auto& options : param_options) {
      dtypes.push_back(c10::typeMetaToScalarType(options.dtype()));
    }
    std::string error;
    try {
      param_swapper_ = std::make_unique<NvmeParameterSwapper>(
          *layout_, std::move(dtypes), options_.offload_param(), options_.aio(),
          groups_->shard().rank());
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    }
    const std::string agreed = groups_->agree(error, "nvme_param_setup");
    TORCH_CHECK(agreed.empty(), "could not set up the NVMe swap space for parameters: ", agreed);
  }
  build_gradient_reduction();
  build_group_shards();
  std::vector<std::vector<ShardSegment>> segments;
  std::vector<at::TensorOptions> state_options;  // where each group's states are
  for (size_t g = 0; g < buffers_.size(); ++g) {
    segments.push_back(buffers_[g].segments);
    state_options.push_back(fp32_options().device(
        state_tier(g) == StateTier::kDevice ? device_ : c10::Device(c10::kCPU)));
  }
  parameter_states_ = ParameterStates(param_groups_, segments, state_options);
  device_storage_->set_parameter_states(&parameter_states_);
  gradients_->expect_current_gradients();  // the parameters as the shards left them
  if (gatherer_ && options_.check_collective_order() && groups_->shard().world_size() > 1) {
    // See [Note: Negotiated collectives].
    GradientBuckets& buckets = gradients_->buckets();
    buckets.set_launch_on_agreement(true);
    gatherer_->negotiate(std::make_unique<CollectiveAgreement>(
                             groups_->shard(), gatherer_->num_units(), buckets.num_buckets()),
                         &buckets);
  }
  bool waiting_for_adoption = false;
  for (const auto& group : replacements_) {
    for (const auto& replacement : group) {
      waiting_for_adoption = waiting_for_adoption || replacement.defined();
    }
  }
  if (gradients_->uses_hooks() && !waiting_for_adoption) {
    gradients_->install_hooks();
  }
}

void ZeroOptimizer::Impl::build_gradient_reduction() {
  std::vector<at::TensorOptions> grad_options;
  for (const GroupBuffers& shard : buffers_) {
    grad_options.push_back(options_.reduce_in_fp32() ? shard.param_options.dtype(at::kFloat)
                                                     : shard.param_options);
  }
  gradients_ = std::make_unique<GradientReduction>(GradientReduction::Parts{
      options_, param_groups_, *layout_, *groups_, *placement_, std::move(grad_options),
      offloaded_ ? offloaded_->gradient_swapper() : nullptr,
      /*defers_scale=*/offloaded_ != nullptr, stage3_events_.get(), host_syncs_});
}

std::vector<std::vector<int64_t>> ZeroOptimizer::Impl::assign_units(
    const std::vector<ParameterUnit>& units, std::vector<std::string>& unit_names,
    std::vector<std::vector<at::Tensor>>& unit_params) {
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
      const auto found = param_index_.find(unit.params[p]);
      TORCH_CHECK_VALUE(found, "parameter ", p, " of unit '", unit.name,
                        "' is not one of the optimizer's parameters; pass every parameter of "
                        "the units to the optimizer");
      const auto [g, i] = *found;
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

std::vector<BucketId> ZeroOptimizer::Impl::buckets_of(const std::vector<at::Tensor>& params) const {
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
  for (size_t p = 0; p < params.size(); ++p) {
    const auto found = param_index_.find(params[p]);
    TORCH_CHECK_VALUE(found, "tensor ", p, " is not one of this optimizer's parameters");
    add(found->first, found->second);
  }
  return buckets;
}

const at::Tensor& ZeroOptimizer::Impl::flat_parameters(size_t group) const {
  TORCH_CHECK_INDEX(group < buffers_.size(), "group ", group, " out of range [0, ", buffers_.size(),
                    ")");
  TORCH_CHECK(options_.stage() < 3,
              "flat_parameters() is a stage 1/2 view; at stage 3 parameters are gathered per "
              "unit (use full_parameters() or pin_parameters())");
  return buffers_[group].flat_param;
}

void ZeroOptimizer::Impl::check_groups_fixed() const {
  // torch::optim::Optimizer::add_param_group is not virtual: a group added
  // after construction has no place in the partition layout.
  TORCH_CHECK(param_groups_.size() == layout_->groups().size(), "ZeroOptimizer has ",
              param_groups_.size(), " parameter groups but was built with ",
              layout_->groups().size(),
              ": groups cannot be added after construction (the partition layout is fixed); pass "
              "every group to the constructor");
}

std::unique_ptr<Communicator> ZeroOptimizer::Impl::make_communicator(
    c10::intrusive_ptr<c10d::ProcessGroup> group) const {
  auto comm = std::make_unique<Communicator>(std::move(group));
  comm->set_device(device_);
  comm->set_host_sync_counter(&host_syncs_);
  comm->set_reduce_scatter_all_to_all(options_.gloo_reduce_scatter_all_to_all());
  comm->set_all_gather_broadcasts(options_.gloo_all_gather_broadcasts());
  return comm;
}

}  // namespace zeroshard
