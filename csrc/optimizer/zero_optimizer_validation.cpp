// ZeroOptimizer: checks of options and parameters at construction, and the
// cross-rank agreement on the partition layout.
#include "zero_optimizer_impl.h"

#include "zeroshard/error_agreement.h"
#include "zeroshard/update_rule.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <type_traits>
#include <unordered_map>

namespace zeroshard {

void validate_zero_options(const ZeroOptions& options, int64_t world_size) {
  TORCH_CHECK_VALUE(options.stage() >= 1 && options.stage() <= 3, "unsupported ZeRO stage ",
                    options.stage(),
                    "; zeroshard implements stage 1 (optimizer state sharding), stage 2 "
                    "(optimizer state and gradient sharding) and stage 3 (parameters too)");
  // The scalar options' ranges: [Note: one list of the scalar options].
  for_each_scalar_zero_option(options, [](const ZeroOptionInfo& info, const auto& value) {
    TORCH_CHECK_VALUE(*info.rule == '\0' || static_cast<double>(value) >= info.least, info.name,
                      " must be ", info.rule, ", got ", value);
  });
  check_aio_options(options.aio());
  const std::pair<const char*, const OffloadOptions*> offloads[] = {
      {"offload_optimizer", &options.offload_optimizer()},
      {"offload_param", &options.offload_param()}};
  for (const auto& [which, offload_ptr] : offloads) {
    const OffloadOptions& offload = *offload_ptr;
    const bool parameters = std::string(which) == "offload_param";
    TORCH_CHECK_VALUE(
        !parameters || offload.device() != OffloadDevice::kNVMe ||
            options.offload_optimizer().enabled(),
        "offload_param.device = 'nvme' needs offload_optimizer.device = 'cpu' or 'nvme': the "
        "step writes the new parameter shards to disk from the offloaded fp32 master (as in "
        "DeepSpeed's ZeRO-Infinity configurations, which offload both)");
    TORCH_CHECK_VALUE(offload.device() != OffloadDevice::kNVMe || !offload.nvme_path().empty(),
                      which,
                      ".device = 'nvme' needs nvme_path: a directory on the disk to swap to");
    TORCH_CHECK_VALUE(offload.ratio() >= 0 && offload.ratio() <= 1, which,
                      ".ratio must be in [0, 1] (the fraction of the optimizer state offloaded), "
                      "got ",
                      offload.ratio());
    TORCH_CHECK_VALUE(
        offload.buffer_count() >= 0 && offload.buffer_size() >= 0 && offload.max_in_cpu() >= 0,
        which, ": buffer_count, buffer_size and max_in_cpu must be >= 0");
  }
  TORCH_CHECK_VALUE(!options.offload_param().enabled() || options.stage() == 3,
                    "offload_param moves parameter shards and needs ZeRO stage 3 (as in "
                    "DeepSpeed); this optimizer has stage ",
                    options.stage(),
                    ". Use offload_optimizer to offload the optimizer state at stages 1 and 2");
  if (options.offload_optimizer().swap_gradients()) {
    const OffloadOptions& offload = options.offload_optimizer();
    TORCH_CHECK_VALUE(offload.device() == OffloadDevice::kNVMe,
                      "offload_optimizer.swap_gradients puts the gradient shard in the NVMe swap "
                      "space and needs offload_optimizer.device = 'nvme'; it is '",
                      offload_device_name(offload.device()), "'");
    TORCH_CHECK_VALUE(options.stage() >= 2,
                      "offload_optimizer.swap_gradients needs ZeRO stage 2 or 3: stage 1 keeps "
                      "every full gradient in .grad, so swapping its 1/N shard saves nothing; "
                      "this optimizer has stage ",
                      options.stage());
    TORCH_CHECK_VALUE(offload.ratio() == 1.0,
                      "offload_optimizer.swap_gradients needs ratio 1 (every sub-group on NVMe): "
                      "sub-groups updated on the device read the gradient shard there; ratio is ",
                      offload.ratio());
  }
  TORCH_CHECK_VALUE(options.offload_param().ratio() == 1.0,
                    "offload_param has no ratio (DeepSpeed's ratio is an offload_optimizer key)");
  TORCH_CHECK_VALUE(
      options.broadcast_from_rank() >= 0 && options.broadcast_from_rank() < world_size,
      "broadcast_from_rank must be a rank in [0, ", world_size, "), got ",
      options.broadcast_from_rank());
  TORCH_CHECK_VALUE(
      std::isfinite(options.gradient_divide_factor()) && options.gradient_divide_factor() >= 0,
      "gradient_divide_factor must be > 0 (or 0 for the data-parallel world size), "
      "got ",
      options.gradient_divide_factor());
}

void ZeroOptimizer::Impl::validate_parameters() const {
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
      // A stage-3 optimizer releases gathered parameters by emptying their
      // storage; one destroyed while they were released leaves the model's
      // tensors with nothing behind them, and reading them would crash.
      int64_t extent = param.storage_offset() + 1;  // elements up to the last one
      for (int64_t d = 0; d < param.dim() && param.numel() > 0; ++d) {
        extent += (param.size(d) - 1) * param.stride(d);
      }
      const auto needed = static_cast<size_t>(extent) * param.element_size();
      TORCH_CHECK_VALUE(
          param.is_meta() || param.numel() == 0 || !param.has_storage() ||
              (param.storage().nbytes() >= needed && param.storage().data() != nullptr),
          "parameter ", i, " of group ", g, " (shape ", param.sizes(),
          ") has no values: its storage holds ", param.storage().nbytes(), " bytes, it needs ",
          needed,
          ". It is partitioned by a stage 3 ZeroOptimizer (one since destroyed, or another "
          "still holding this model); "
          "take the full values before dropping that optimizer (full_state_dict(), "
          "or load a checkpoint) and build the new one from a model holding them");
      auto [it, inserted] = seen.emplace(param.unsafeGetTensorImpl(), std::make_pair(g, i));
      TORCH_CHECK_VALUE(inserted, "some parameters appear more than once: parameter ", i,
                        " of group ", g, " is also parameter ", it->second.second, " of group ",
                        it->second.first, "; each parameter may belong to exactly one group, once");
    }
  }
}

// [Note: what the ranks must agree on]
// Every rank must build its optimizer alike: the same parameters (the
// layout's fingerprint), options and hyper-parameters per group. A rank that
// differs either issues other collectives (another stage or bucket size) or
// trains silently otherwise (each shard updated with its owner's lr).
// Construction compares every such value in one all-reduce of extremes (a
// value and its complement: the largest and the smallest of each), and when
// some differ the ranks exchange their own values of those to name them:
// "stage: rank 0: 2; rank 1: 3". Hyper-parameters may change between steps
// (a scheduler, an edit of param_groups), on every rank alike: each step puts
// a hash of them into the flags all-reduce it makes anyway (two more int32s,
// no collective of its own), and only when the hashes differ do the ranks
// compare the values themselves, to raise naming them.
namespace {

struct AgreedValue {
  std::string name;  // as messages say it
  int64_t bits;      // what the extremes compare: a double's bits, an integer, a flag
  std::string text;  // this rank's value, as messages say it
};

int64_t bits_of(double value) {
  int64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// What the ranks compare of one hyper-parameter: a boolean or a number
// exactly; anything else an update rule takes (null, a string) by a hash of
// its text, the same function of the bytes on every rank.
int64_t agreed_bits(const nlohmann::json& value) {
  if (value.is_boolean()) {
    return static_cast<int64_t>(value.get<bool>());
  }
  if (value.is_number()) {
    return bits_of(value.get<double>());
  }
  const std::string text = value.dump();
  return static_cast<int64_t>(std::hash<std::string>{}(text));
}

std::vector<AgreedValue> hyperparameter_values(
    InnerOptimizerKind kind, const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<AgreedValue> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    const nlohmann::json values = inner_options_to_json(kind, groups[g].options());
    for (auto it = values.begin(); it != values.end(); ++it) {
      const std::string name = "group " + std::to_string(g) + " " + it.key();
      const std::string text = it.value().dump();
      // A tuple (betas) is one value per element under one name.
      const std::vector<nlohmann::json> elements =
          it.value().is_array() ? std::vector<nlohmann::json>(it.value().begin(), it.value().end())
                                : std::vector<nlohmann::json>{it.value()};
      for (const auto& element : elements) {
        out.push_back({name, agreed_bits(element), text});
      }
    }
  }
  return out;
}

std::vector<AgreedValue> option_values(const ZeroOptions& options, const std::string& rule) {
  std::vector<AgreedValue> out;
  out.push_back(
      {"optimizer", static_cast<int64_t>(std::hash<std::string>{}(rule)&0x7fffffffffffffff), rule});
  for_each_scalar_zero_option(options, [&](const ZeroOptionInfo& info, const auto& value) {
    using Value = std::decay_t<decltype(value)>;
    std::ostringstream text;
    text << std::boolalpha << value;
    int64_t bits = 0;
    if constexpr (std::is_floating_point_v<Value>) {
      bits = bits_of(static_cast<double>(value));
    } else {
      bits = static_cast<int64_t>(value);
    }
    out.push_back({info.name, bits, text.str()});
  });
  for (const auto& [name, offload] :
       {std::make_pair("offload_optimizer", &options.offload_optimizer()),
        std::make_pair("offload_param", &options.offload_param())}) {
    out.push_back({std::string(name) + ".device", static_cast<int64_t>(offload->device()),
                   offload_device_name(offload->device())});
  }
  return out;
}

// Collective over the shard group and the replicas: the names of the values
// that differ between ranks, in `values`' order, the same on every rank.
std::vector<std::string> differing_values(const ProcessGroups& groups,
                                          const std::vector<AgreedValue>& values,
                                          const std::string& tag) {
  std::vector<int64_t> bits;
  for (const AgreedValue& value : values) {
    bits.push_back(value.bits);
  }
  std::vector<AgreementGroup> scope = groups.scope();
  scope.resize(2);  // the shard group and the replicas
  const std::vector<bool> same = groups.same_on_every_rank(bits, tag, scope);
  std::vector<std::string> names;
  for (size_t i = 0; i < values.size(); ++i) {
    if (!same[i] && std::find(names.begin(), names.end(), values[i].name) == names.end()) {
      names.push_back(values[i].name);
    }
  }
  return names;
}

// Collective (the ranks that found `names` differ, every one of them): each
// rank's values of `names`, "rank 0: stage 2; rank 1: stage 3" (ranks alike
// named together).
std::string each_ranks_values(const ProcessGroups& groups, const std::vector<AgreedValue>& values,
                              const std::vector<std::string>& names, const std::string& tag) {
  std::string mine;
  for (const std::string& name : names) {
    const auto found = std::find_if(values.begin(), values.end(),
                                    [&](const AgreedValue& v) { return v.name == name; });
    mine += (mine.empty() ? "" : ", ") + name + " = " + found->text;
  }
  // The shard group and the replicas: the model-parallel group's ranks
  // compared nothing (the extremes do not span it).
  std::vector<AgreementGroup> scope = groups.scope();
  scope.resize(2);
  return each_rank_says(scope, mine, tag);
}

}  // namespace

void ZeroOptimizer::Impl::check_layout_agrees_across_ranks() {
  const int64_t fingerprint = layout_->fingerprint();
  const std::string layout_name = "partition layout";
  std::vector<AgreedValue> values = option_values(options_, rule_name());
  const std::vector<AgreedValue> hyper = hyperparameter_values(inner_kind_, param_groups_);
  values.insert(values.end(), hyper.begin(), hyper.end());
  values.push_back({layout_name, fingerprint, std::to_string(fingerprint)});
  std::vector<std::string> names = differing_values(*groups_, values, "layout_check");
  if (names.empty()) {
    return;
  }
  if (names.size() > 1) {
    // Another stage or bucket size lays the parameters out differently too:
    // the options are the cause to name.
    names.erase(std::remove(names.begin(), names.end(), layout_name), names.end());
  }
  const std::string each = each_ranks_values(*groups_, values, names, "layout_check/values");
  TORCH_CHECK(names != std::vector<std::string>{layout_name},
              "ranks built different partition layouts (", each,
              "): every rank must pass the same parameters, with the same shapes, in the "
              "same groups and order");
  TORCH_CHECK_VALUE(false,
                    "ranks built their ZeroOptimizers with different options or "
                    "hyper-parameters: ",
                    each, ". Every rank must pass the same ones");
}

void ZeroOptimizer::Impl::check_rule_parameters() const {
  if (inner_kind_ != InnerOptimizerKind::kRule) {
    return;
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& options = static_cast<const RuleOptions&>(param_groups_[g].options());
    const auto& params = param_groups_[g].params();
    const bool whole = options.rule()->whole_parameters(options.hyperparameters());
    for (size_t i = 0; i < params.size(); ++i) {
      try {
        options.rule()->check_parameter(params[i].sizes().vec(), options.hyperparameters());
        // [Note: parameter states] are held by one owner: asked here, on
        // every rank, for every parameter, not on the owner alone later.
        const auto specs =
            options.rule()->parameter_states(params[i].sizes().vec(), options.hyperparameters());
        TORCH_CHECK_VALUE(specs.empty() || whole,
                          "it keeps states of a shape of their own (parameter_states), which "
                          "needs each parameter whole on one rank: its whole_parameters() must "
                          "return true");
        for (const ParameterStateSpec& spec : specs) {
          TORCH_CHECK_VALUE(spec.name != "master",
                            "it names a parameter state \"master\": that "
                            "name is the fp32 master weights'");
          optimizer_state_named(spec.name);  // registers it, or refuses the name
          for (int64_t size : spec.sizes) {
            TORCH_CHECK_VALUE(size >= 0, "it gives state '", spec.name, "' the shape ", spec.sizes,
                              "; sizes must be >= 0");
          }
        }
        if (whole) {  // the owners are balanced by it: a NaN would break the sort
          const double cost =
              options.rule()->update_cost(params[i].sizes().vec(), options.hyperparameters());
          TORCH_CHECK_VALUE(std::isfinite(cost) && cost >= 0, "its update_cost() is ", cost,
                            "; expected a finite number >= 0");
        }
      } catch (const c10::Error& e) {
        TORCH_CHECK_VALUE(false, "update rule ", options.rule()->name(),
                          " cannot update parameter ", i, " of group ", g, " (shape ",
                          params[i].sizes(), "): ", e.what_without_backtrace());
      }
    }
  }
}

std::string ZeroOptimizer::Impl::rule_name() const {
  // Each group of an UpdateRule optimizer may run its own rule.
  std::vector<std::string> names;
  for (const auto& group : param_groups_) {
    std::string name = update_rule_name(inner_kind_, group.options());
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      names.push_back(std::move(name));
    }
  }
  if (names.empty()) {
    return inner_optimizer_name(inner_kind_);
  }
  std::string out = names[0];
  for (size_t i = 1; i < names.size(); ++i) {
    out += ", " + names[i];
  }
  return out;
}

int32_t ZeroOptimizer::Impl::hyperparameter_hash() const {
  std::string all;
  for (const auto& group : param_groups_) {
    all += inner_options_to_json(inner_kind_, group.options()).dump();
  }
  // std::hash<std::string> is a fixed function of the bytes in libstdc++ (no
  // per-process seed), and every rank runs the same library.
  return static_cast<int32_t>(std::hash<std::string>{}(all)&0x7fffffff);
}

void ZeroOptimizer::Impl::raise_hyperparameter_difference() {
  const std::vector<AgreedValue> values = hyperparameter_values(inner_kind_, param_groups_);
  const std::vector<std::string> names = differing_values(*groups_, values, "hyperparameter_check");
  const std::string each =
      names.empty() ? std::string("the values agree; their hashes did not")
                    : each_ranks_values(*groups_, values, names, "hyperparameter_check/values");
  TORCH_CHECK_VALUE(false, "step() refused: the ranks' hyper-parameters differ (", each,
                    "). Every rank must set the same ones: change them (a scheduler, an edit of "
                    "param_groups) alike on every rank; nothing was updated");
}

}  // namespace zeroshard
