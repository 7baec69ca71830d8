// Saving and restoring a ZeroOptimizer's per-rank shard. See
// [Note: Checkpoint format] in docs/design.md.
#include "zero_optimizer_impl.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/serialize/input-archive.h>
#include <torch/csrc/api/include/torch/serialize/output-archive.h>

#include <map>

namespace zeroshard {
namespace {

constexpr int64_t kFormatVersion = 1;
// A group's parameter states, in one tensor ([Note: parameter states]).
constexpr const char* kParameterStatesKey = "parameter_states";

at::Tensor scalar_tensor(int64_t value) { return at::tensor({value}, at::kLong); }

std::string group_key(size_t g, const char* name) {
  return "group" + std::to_string(g) + "_" + name;
}

}  // namespace

ShardState ZeroOptimizer::Impl::shard_state() const {
  step_phase_.check_complete("state_dict()");
  ShardState state;
  state.emplace_back("meta_format_version", scalar_tensor(kFormatVersion));
  state.emplace_back("meta_world_size", scalar_tensor(groups_->shard().world_size()));
  state.emplace_back("meta_rank", scalar_tensor(groups_->shard().rank()));
  state.emplace_back("meta_stage", scalar_tensor(options_.stage()));
  state.emplace_back("meta_inner_optimizer", scalar_tensor(static_cast<int64_t>(inner_kind_)));
  state.emplace_back("meta_layout_fingerprint", scalar_tensor(layout_->fingerprint()));
  state.emplace_back("meta_num_groups", scalar_tensor(static_cast<int64_t>(buffers_.size())));
  for (size_t g = 0; g < buffers_.size(); ++g) {
    const int64_t numel = layout_->group(g).shard_numel();
    state.emplace_back(group_key(g, optimizer_state_name(OptimizerStateName::kMaster)),
                       master_shard(g));
    for (OptimizerStateName name : all_optimizer_states()) {
      if (name != OptimizerStateName::kMaster && storage().has(g, name)) {
        state.emplace_back(
            group_key(g, optimizer_state_name(name)),
            storage().read(g, name, 0, numel, fp32_options().device(storage().home_device())));
      }
    }
    state.emplace_back(group_key(g, "steps"), at::tensor(buffers_[g].steps, at::kLong));
    if (parameter_states_.flat(g).defined()) {  // [Note: parameter states]
      state.emplace_back(group_key(g, kParameterStatesKey), parameter_states_.flat(g).clone());
    }
  }
  return state;
}

void ZeroOptimizer::Impl::load_shard_state(const ShardState& state) {
  // Validate locally, then agree across ranks before touching anything, so a
  // bad file on one rank raises on every rank instead of leaving the others
  // waiting in a collective.
  std::map<std::string, at::Tensor> by_key(state.begin(), state.end());
  std::string error;
  try {
    auto meta = [&](const char* key) {
      auto it = by_key.find(key);
      TORCH_CHECK_VALUE(it != by_key.end(), "not a zeroshard optimizer state: key '", key,
                        "' is missing");
      return it->second.item<int64_t>();
    };
    TORCH_CHECK_VALUE(meta("meta_format_version") == kFormatVersion,
                      "zeroshard optimizer state has format version ", meta("meta_format_version"),
                      "; this build reads version ", kFormatVersion);
    const int64_t saved_world = meta("meta_world_size");
    TORCH_CHECK_VALUE(saved_world == groups_->shard().world_size(),
                      "this optimizer state was saved by a run with world size ", saved_world,
                      " but this run has world size ", groups_->shard().world_size(),
                      "; zeroshard resumes only at the world size it saved "
                      "(resharding a checkpoint to another world size is not supported yet)");
    TORCH_CHECK_VALUE(meta("meta_rank") == groups_->shard().rank(),
                      "this optimizer state belongs to rank ", meta("meta_rank"),
                      " but was loaded on rank ", groups_->shard().rank(),
                      "; each rank must load the state it saved");
    TORCH_CHECK_VALUE(meta("meta_stage") == options_.stage(),
                      "this optimizer state was saved at ZeRO stage ", meta("meta_stage"),
                      " but this optimizer runs stage ", options_.stage());
    TORCH_CHECK_VALUE(meta("meta_inner_optimizer") == static_cast<int64_t>(inner_kind_),
                      "this optimizer state was saved by another inner optimizer than ",
                      inner_optimizer_name(inner_kind_));
    TORCH_CHECK_VALUE(meta("meta_layout_fingerprint") == layout_->fingerprint(),
                      "this optimizer state was saved with another partition layout "
                      "(different parameters, groups or reduce_bucket_size)");
    for (size_t g = 0; g < buffers_.size(); ++g) {
      for (OptimizerStateName state : all_optimizer_states()) {
        auto it = by_key.find(group_key(g, optimizer_state_name(state)));
        if (it != by_key.end()) {
          TORCH_CHECK_VALUE(it->second.numel() == layout_->group(g).shard_numel(), "state '",
                            it->first, "' has ", it->second.numel(), " elements, expected ",
                            layout_->group(g).shard_numel());
        }
      }
      // The same layout owns the same whole parameters: the same parameter
      // states, in one tensor per group.
      const at::Tensor& own = parameter_states_.flat(g);
      auto parameter_states = by_key.find(group_key(g, kParameterStatesKey));
      TORCH_CHECK_VALUE((parameter_states == by_key.end() && !own.defined()) ||
                            (parameter_states != by_key.end() && own.defined() &&
                             parameter_states->second.numel() == own.numel()),
                        "state '", group_key(g, kParameterStatesKey), "' is ",
                        parameter_states == by_key.end()
                            ? std::string("missing")
                            : std::to_string(parameter_states->second.numel()) + " elements",
                        "; this optimizer's update rule keeps ", own.defined() ? own.numel() : 0,
                        " elements of parameter states on this rank");
      const std::string master = group_key(g, optimizer_state_name(OptimizerStateName::kMaster));
      TORCH_CHECK_VALUE(by_key.count(master) == 1, "state '", master, "' is missing");
      auto it = by_key.find(group_key(g, "steps"));
      TORCH_CHECK_VALUE(it != by_key.end() &&
                            it->second.numel() == static_cast<int64_t>(buffers_[g].steps.size()),
                        "state '", group_key(g, "steps"), "' is missing or has the wrong size");
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  groups_->raise_if_any_failed(
      error, "load its zeroshard optimizer state; nothing was loaded on any rank", "shard_state");
  // From here the state is being written: a failure leaves it incomplete
  // ([Note: the step's phase]) until a load succeeds.
  try {
    at::NoGradGuard no_grad;
    for (size_t g = 0; g < buffers_.size(); ++g) {
      write_master(g, 0,
                   by_key.at(group_key(g, optimizer_state_name(OptimizerStateName::kMaster)))
                       .to(fp32_options()));
      for (OptimizerStateName name : all_optimizer_states()) {
        auto it = by_key.find(group_key(g, optimizer_state_name(name)));
        if (name != OptimizerStateName::kMaster && it != by_key.end()) {
          storage().write(g, name, 0, it->second);
        }
      }
      if (parameter_states_.flat(g).defined()) {
        parameter_states_.flat(g).copy_(by_key.at(group_key(g, kParameterStatesKey)));
      }
      at::Tensor steps = by_key.at(group_key(g, "steps")).cpu().to(at::kLong).contiguous();
      const auto* data = steps.data_ptr<int64_t>();
      buffers_[g].steps.assign(data, data + steps.numel());
    }
    if (offloaded_) {
      refresh_parameters_from_master();
    }
    gather_parameters();
  } catch (const c10::Error& e) {
    step_phase_.mark_incomplete(std::string("a load_state_dict() failed partway: ") +
                                e.what_without_backtrace());
    throw;
  } catch (const std::exception& e) {
    step_phase_.mark_incomplete(std::string("a load_state_dict() failed partway: ") + e.what());
    throw;
  }
  step_phase_.restored();  // [Note: the step's phase]
}

// [Note: optimizer.state, this rank's part]
// Scripts and libraries read torch.optim's optimizer.state[p]["exp_avg"]. A
// rank holds only the elements of p it owns (one contiguous run of the
// flattened parameter: a parameter lies in one bucket), so that is what it
// answers, as FSDP2's sharded state does: 1-D copies of the owned elements,
// empty where it owns none, with torch.optim's names and its laziness (no
// state before the parameter's first update). Copies, because an offloaded
// or NVMe-swapped state has no tensor to view; one parameter's part is read
// per call, never the whole shard. Writes go through write_parameter_state.
namespace {

const ShardSegment* owned_segment(const std::vector<ShardSegment>& segments, int64_t index) {
  for (const ShardSegment& segment : segments) {
    if (segment.param_index == index) {
      return &segment;
    }
  }
  return nullptr;
}

}  // namespace

ZeroOptimizer::ParameterStatePart ZeroOptimizer::Impl::parameter_state(size_t group, int64_t index,
                                                                       bool read_states) const {
  TORCH_CHECK_INDEX(group < buffers_.size(), "parameter group ", group, " of ", buffers_.size());
  const GroupBuffers& shard = buffers_[group];
  TORCH_CHECK_INDEX(index >= 0 && index < static_cast<int64_t>(shard.steps.size()), "parameter ",
                    index, " of group ", group, ", which has ", shard.steps.size());
  ZeroOptimizer::ParameterStatePart part;
  part.steps = shard.steps[index];
  const ShardSegment* segment = owned_segment(shard.segments, index);
  if (segment != nullptr) {
    part.param_offset = segment->param_offset;
    part.numel = segment->numel;
  }
  if (part.steps == 0 || !read_states) {
    return part;  // torch.optim creates a parameter's state at its first update
  }
  const auto& options = param_groups_[group].options();
  for (OptimizerStateName name : inner_optimizer_states(inner_kind_, options)) {
    if (!storage().has(group, name)) {
      continue;
    }
    const at::TensorOptions where = fp32_options().device(storage().home_device());
    part.states.emplace_back(
        optimizer_state_name(name),
        part.numel == 0 ? at::empty({0}, where)
                        : storage().read(group, name, segment->shard_offset, part.numel, where));
  }
  // [Note: parameter states]: the owner's in their shapes, empty elsewhere.
  const std::vector<at::Tensor> own = parameter_states_.views(group, index);
  const std::vector<ParameterStateSpec> specs =
      ParameterStates::specs(param_groups_[group], static_cast<size_t>(index));
  for (size_t k = 0; k < specs.size(); ++k) {
    part.states.emplace_back(specs[k].name,
                             k < own.size()
                                 ? own[k].clone()
                                 : at::empty({0}, fp32_options().device(storage().home_device())));
  }
  return part;
}

void ZeroOptimizer::Impl::write_parameter_state(size_t group, int64_t index,
                                                const std::string& name, const at::Tensor& values) {
  const ZeroOptimizer::ParameterStatePart part = parameter_state(group, index, true);
  bool known = false;
  std::string names;
  for (const auto& [present, tensor] : part.states) {
    known = known || present == name;
    names += (names.empty() ? "" : ", ") + present;
  }
  TORCH_CHECK_VALUE(known, "cannot write optimizer state '", name, "' of parameter ",
                    param_index_.name(group, static_cast<size_t>(index)), ": it holds ",
                    names.empty() ? std::string("no state yet (before its first step)") : names);
  at::NoGradGuard no_grad;
  // [Note: parameter states]: the owner's, whole, in their shape.
  const std::vector<ParameterStates::Entry>& entries = parameter_states_.entries(group, index);
  for (size_t k = 0; k < entries.size(); ++k) {
    if (name == optimizer_state_name(entries[k].name)) {
      TORCH_CHECK_VALUE(values.numel() == entries[k].numel, "optimizer state '", name,
                        "' of parameter ", param_index_.name(group, static_cast<size_t>(index)),
                        " has shape ", entries[k].sizes, ", got ", values.numel(), " values");
      parameter_states_.views(group, index)[k].copy_(values.detach().reshape(entries[k].sizes));
      return;
    }
  }
  TORCH_CHECK_VALUE(values.numel() == part.numel, "optimizer state '", name, "' of parameter ",
                    param_index_.name(group, static_cast<size_t>(index)), ": this rank owns ",
                    part.numel,
                    " of its elements (optimizer.state[p] holds this rank's part), got ",
                    values.numel(), " values");
  if (part.numel == 0) {
    return;
  }
  const ShardSegment* segment = owned_segment(buffers_[group].segments, index);
  for (OptimizerStateName state : all_optimizer_states()) {
    if (name == optimizer_state_name(state)) {
      storage().write(group, state, segment->shard_offset, values.detach().reshape({-1}));
    }
  }
}

void ZeroOptimizer::Impl::save(torch::serialize::OutputArchive& archive) const {
  for (const auto& [key, tensor] : shard_state()) {
    archive.write(key, tensor);
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    torch::serialize::OutputArchive options_archive(archive.compilation_unit());
    param_groups_[g].options().serialize(options_archive);
    archive.write(group_key(g, "options"), options_archive);
  }
}

void ZeroOptimizer::Impl::load(torch::serialize::InputArchive& archive) {
  ShardState state;
  auto read = [&](const std::string& key) {
    at::Tensor tensor;
    if (archive.try_read(key, tensor)) {
      state.emplace_back(key, tensor);
    }
  };
  for (const char* key : {"meta_format_version", "meta_world_size", "meta_rank", "meta_stage",
                          "meta_inner_optimizer", "meta_layout_fingerprint", "meta_num_groups"}) {
    read(key);
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (OptimizerStateName state : all_optimizer_states()) {
      read(group_key(g, optimizer_state_name(state)));
    }
    read(group_key(g, "steps"));
    read(group_key(g, kParameterStatesKey));
  }
  load_shard_state(state);
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    torch::serialize::InputArchive options_archive;
    if (archive.try_read(group_key(g, "options"), options_archive)) {
      param_groups_[g].options().serialize(options_archive);
    }
  }
}

}  // namespace zeroshard
