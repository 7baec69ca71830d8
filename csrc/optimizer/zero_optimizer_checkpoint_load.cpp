// ZeroOptimizer::load_checkpoint: reads the ranges this rank owns now from a
// checkpoint saved at any layout. See [Note: Checkpoint pieces] in
// zero_optimizer_checkpoint.cpp and docs/design.md ("Checkpoints").
#include "../checkpoint/checkpoint_detail.h"
#include "../checkpoint/checkpoint_reader.h"
#include "zero_optimizer_impl.h"
#include "zeroshard/builtin_rule.h"
#include "zeroshard/crc32c.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <unordered_map>

namespace zeroshard {

using json = nlohmann::json;
using checkpoint_detail::message_of;

namespace {

// Each parameter's states are the ones its rule keeps: a parameter saved
// by Muon (a momentum) loaded into AdamW would start AdamW's moments at zero
// without a word. Checkpoints before the per-parameter "rule" name the
// optimizer's rules as a whole.
// Adam, AdamW and SGD keep the same states as the built-in kernels ("adamw")
// and as a rule (torch.optim.AdamW from Python, BuiltinRule): one name.
std::string rule_key(const std::string& name) {
  for (InnerOptimizerKind kind :
       {InnerOptimizerKind::kAdam, InnerOptimizerKind::kAdamW, InnerOptimizerKind::kSGD}) {
    if (name == inner_optimizer_name(kind)) {
      return BuiltinRule(kind).name();
    }
  }
  return name;
}

// `rules`: each of this optimizer's parameters' name and rule; `all_rules`:
// the optimizer's (rule_name()).
void check_saved_rules(const json& index, const std::string& path,
                       const std::vector<std::pair<std::string, std::string>>& rules,
                       const std::string& all_rules) {
  std::unordered_map<std::string, std::string> saved;
  bool per_parameter = true;
  for (const json& param : index.at("params")) {
    const auto rule = param.find("rule");
    if (rule == param.end()) {
      per_parameter = false;
      break;
    }
    saved[param.at("name").get<std::string>()] = rule->get<std::string>();
    for (const json& alias : param.value("aliases", json::array())) {
      saved[alias.get<std::string>()] = rule->get<std::string>();
    }
  }
  if (!per_parameter) {
    TORCH_CHECK_VALUE(index.at("inner_optimizer").get<std::string>() == all_rules, "checkpoint ",
                      path, " holds the state of optimizer ", index.at("inner_optimizer"),
                      " but this optimizer is ", all_rules,
                      "; load with load_optimizer_states=false to take its weights only");
    return;
  }
  for (const auto& [name, ours] : rules) {
    const auto it = saved.find(name);
    TORCH_CHECK_VALUE(it == saved.end() || rule_key(it->second) == rule_key(ours), "checkpoint ",
                      path, " holds the state ", it->second, " keeps for parameter '", name,
                      "', which this optimizer updates with ", ours,
                      "; build the groups as they were saved, or load with "
                      "load_optimizer_states=false to take the weights only");
  }
}

}  // namespace

LoadedCheckpoint ZeroOptimizer::Impl::load_checkpoint(const std::string& path_in,
                                                      const CheckpointLoadOptions& options) {
  check_groups_fixed();
  // An asynchronous save still being written: its failure is reported through
  // the agreement below, so every rank raises together.
  std::string error = async_saver_.finish();
  LoadedCheckpoint result;
  result.path = checkpoint_path(path_in, "");
  const std::string& path = result.path;
  const bool with_state = options.load_optimizer_states();
  const bool model_parallel = groups_->model_parallel() != nullptr;
  std::unique_ptr<CheckpointReader> reader;
  std::vector<std::vector<at::Tensor>> loaded(buffers_.size());
  std::vector<std::vector<int64_t>> steps(buffers_.size());
  std::vector<at::Tensor> loaded_parameter_states(buffers_.size());
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> saved_options;
  bool same_grouping = false;  // the saved groups are this optimizer's
  int64_t index_crc = 0;
  // [Note: streaming load] With the optimizer state on NVMe the whole state
  // does not fit in host memory (that is why it is there): the pieces are
  // read and verified once before anything changes, holding nothing, and
  // read again after every rank agreed, each range written straight into
  // the swap space. Otherwise each state's new shard is assembled in host
  // memory from one pass.
  const bool streaming = offloaded_ && placement_->offload_tier() == StateTier::kNVMe;
  // Per group, the states the second pass writes (the master always).
  std::vector<std::vector<OptimizerStateName>> streamed(buffers_.size());
  try {
    TORCH_CHECK_VALUE(error.empty(), error);
    reader = std::make_unique<CheckpointReader>(path);
    const json& index = reader->index();
    const std::string dumped = index.dump();
    index_crc = crc32c(dumped.data(), dumped.size());
    if (with_state) {
      std::vector<std::pair<std::string, std::string>> rules;
      for (size_t g = 0; g < param_groups_.size(); ++g) {
        for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
          rules.emplace_back(parameter_name(g, i),
                             update_rule_name(inner_kind_, param_groups_[g].options()));
        }
      }
      check_saved_rules(index, path, rules, rule_name());
    }
    // Match this optimizer's parameters with the saved ones by name. Under
    // tensor/expert parallelism another rank may hold a saved one (its
    // experts): checked over every rank once all have read the index.
    std::vector<std::vector<CheckpointReader::Parameter>> parameters(param_groups_.size());
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
        parameters[g].push_back({parameter_name(g, i), tensor_parallel_split(g, i),
                                 param_groups_[g].params()[i].sizes().vec()});
      }
    }
    reader->match(std::move(parameters), /*others_may_hold=*/model_parallel);

    // Hyper-parameters follow the saved groups when the grouping is the same;
    // then they, not the current ones, say which states exist (amsgrad,
    // momentum). Applied only after every rank agreed.
    same_grouping = with_state && reader->same_grouping(model_parallel);
    for (size_t g = 0; same_grouping && g < param_groups_.size(); ++g) {
      saved_options.push_back(param_groups_[g].options().clone());
      apply_inner_options_json(inner_kind_, *saved_options.back(),
                               index.at("groups")[g].at("hyperparameters"));
    }
    // Read the ranges this rank owns now, piece by piece, checksums verified.
    for (size_t g = 0; g < buffers_.size(); ++g) {
      const int64_t shard_numel = layout_->group(g).shard_numel();
      const torch::optim::OptimizerOptions& group_options =
          same_grouping ? *saved_options[g] : param_groups_[g].options();
      for (OptimizerStateName state : all_optimizer_states()) {
        const bool wanted =
            state == OptimizerStateName::kMaster ||
            (with_state && inner_optimizer_uses_state(inner_kind_, group_options, state));
        if (!wanted) {
          continue;
        }
        if (streaming) {
          // The first pass: every piece read and verified, nothing kept.
          const bool any = reader->visit_state(
              g, buffers_[g].segments, state, [](int64_t, const float*, int64_t) {},
              [](int64_t, int64_t) {});
          if (any || state == OptimizerStateName::kMaster) {
            streamed[g].push_back(state);
          }
          continue;
        }
        at::Tensor values = at::zeros({shard_numel}, at::kFloat);
        float* target = values.data_ptr<float>();
        const bool any = reader->visit_state(
            g, buffers_[g].segments, state,
            [&](int64_t offset, const float* source, int64_t length) {
              std::memcpy(target + offset, source, static_cast<size_t>(length) * sizeof(float));
            },
            [](int64_t, int64_t) {});  // already zeros
        if (any || state == OptimizerStateName::kMaster) {
          const auto index = static_cast<size_t>(state);
          if (loaded[g].size() <= index) {
            loaded[g].resize(index + 1);
          }
          loaded[g][index] = values;
        }
      }
      steps[g] = reader->saved_steps(g);
      // Whole parameters' states of their own shapes ([Note: parameter
      // states]): each entry as a segment of its own flattening.
      if (with_state && parameter_states_.flat(g).defined()) {
        at::Tensor values = at::zeros({parameter_states_.flat(g).numel()}, at::kFloat);
        float* target = values.data_ptr<float>();
        for (const auto& [param, entries] : parameter_states_.group_entries(g)) {
          const json& saved = reader->saved_entry(g, param);
          for (const ParameterStates::Entry& entry : entries) {
            const std::string name = optimizer_state_name(entry.name);
            // A state of the same name in another shape would read as a
            // range of this one.
            TORCH_CHECK_VALUE(
                !saved.contains("state_shapes") || !saved["state_shapes"].contains(name) ||
                    saved["state_shapes"][name].get<std::vector<int64_t>>() == entry.sizes,
                "checkpoint ", path, " saved ", name, " of parameter '",
                parameter_name(g, static_cast<size_t>(param)), "' with shape ",
                saved.contains("state_shapes") && saved["state_shapes"].contains(name)
                    ? saved["state_shapes"][name].dump()
                    : std::string("?"),
                "; this optimizer's rule keeps it as ", entry.sizes);
            ShardSegment segment;
            segment.param_index = param;
            segment.shard_offset = entry.offset;
            segment.numel = entry.numel;
            reader->visit_state(
                g, {segment}, entry.name,
                [&](int64_t offset, const float* source, int64_t length) {
                  std::memcpy(target + offset, source, static_cast<size_t>(length) * sizeof(float));
                },
                [](int64_t, int64_t) {});  // never stepped: already zeros
          }
        }
        loaded_parameter_states[g] = std::move(values);
      }
    }
    for (const auto& [name, record] : index.at("replicated_files").items()) {
      result.replicated_files[name] = reader->read_verified_file(name, record);
    }
    // The writer that saved files under this rank's number: that rank, or,
    // for a later replica's rank, its first-replica counterpart (rank k of
    // replica r is number r x writers + k). Other numbers find none there.
    const auto saved_writers = static_cast<int64_t>(index.at("rank_files").size());
    if (saved_writers > 0) {
      const int64_t writer = checkpoint_rank() % saved_writers;
      for (const auto& [name, record] : index.at("rank_files")[writer].items()) {
        result.rank_files[name] = reader->read_verified_file(name, record);
      }
    }
  } catch (const std::exception& e) {
    error = message_of(e);
    if (error.empty()) {  // an agreement must see it: the reader may not exist
      error = "reading it failed with an exception that has no message";
    }
  }
  // Replicas load the same files: an error on any rank of any group stops
  // every rank before anything changes.
  const std::string agreed = groups_->agree(error, "checkpoint_errors");
  TORCH_CHECK_VALUE(agreed.empty(), "could not load checkpoint ", path,
                    "; nothing was loaded on any rank ", agreed);
  check_checkpoint_agreement(*reader, index_crc, same_grouping && with_state, with_state);

  at::NoGradGuard no_grad;
  // From here the state is being written: a failure leaves it incomplete
  // ([Note: the step's phase]) until a load succeeds.
  try {
    if (streaming) {
      // The second pass (see [Note: streaming load]): what every rank verified
      // is read again and written range by range into the swap space. A read
      // or write failing now (the files changed since, the disk) is raised on
      // every rank; the state is then partly loaded, as the message says.
      std::string stream_error;
      try {
        for (size_t g = 0; g < buffers_.size(); ++g) {
          for (OptimizerStateName state : streamed[g]) {
            if (state != OptimizerStateName::kMaster && !with_state) {
              continue;
            }
            reader->visit_state(
                g, buffers_[g].segments, state,
                [&](int64_t offset, const float* source, int64_t length) {
                  offloaded_->write(
                      g, state, offset,
                      at::from_blob(const_cast<float*>(source), {length}, at::kFloat));
                },
                [&](int64_t offset, int64_t length) {
                  offloaded_->write(g, state, offset, at::zeros({length}, at::kFloat));
                });
          }
          buffers_[g].steps = steps[g];
        }
      } catch (const std::exception& e) {
        stream_error = message_of(e);
      }
      const std::string agreed = groups_->agree(stream_error, "checkpoint_stream");
      TORCH_CHECK(agreed.empty(), "could not load checkpoint ", path,
                  " into the NVMe swap space (the optimizer state is partly loaded; load it "
                  "again): ",
                  agreed);
    }
    for (size_t g = 0; g < buffers_.size() && !streaming; ++g) {
      write_master(g, 0, loaded[g][0].to(fp32_options()));
      if (!with_state) {
        continue;
      }
      for (size_t k = 1; k < loaded[g].size(); ++k) {
        if (loaded[g][k].defined()) {
          storage().adopt(g, static_cast<OptimizerStateName>(k), loaded[g][k]);
        }
      }
      buffers_[g].steps = steps[g];
      if (loaded_parameter_states[g].defined()) {
        parameter_states_.flat(g).copy_(loaded_parameter_states[g]);
      }
    }
    for (size_t g = 0; g < saved_options.size(); ++g) {
      param_groups_[g].set_options(std::move(saved_options[g]));
    }
    if (offloaded_) {
      refresh_parameters_from_master();
    }
    gather_parameters();
  } catch (const std::exception& e) {
    step_phase_.mark_incomplete("a load of " + path + " failed partway: " + message_of(e));
    throw;
  }
  if (with_state) {
    step_phase_.restored();  // [Note: the step's phase]
  }
  result.index = std::move(*reader).release_index();  // the reader's last use
  return result;
}

void ZeroOptimizer::Impl::check_checkpoint_agreement(const CheckpointReader& reader,
                                                     int64_t index_crc, bool same_grouping,
                                                     bool with_state) {
  const std::string& path = reader.path();
  // Every rank must have read the same checkpoint (a file system that is not
  // shared, or caches a replaced `latest`/index, would mix two), across
  // replicas too (often on other nodes): the largest and smallest checksum
  // over every group, the same two numbers on every rank, so all raise
  // together.
  TORCH_CHECK_VALUE(groups_->same_on_every_rank({index_crc}, "checkpoint_index")[0],
                    "the ranks read different index.json files for checkpoint ", path,
                    " (it must be on a file system every rank sees alike); nothing was loaded");
  // With every index the same, the verdicts below are computed from the same
  // data on every replica: each replica's writers raise alike.
  if (!groups_->model_parallel()) {
    return;
  }
  if (with_state) {
    // Under expert parallelism each rank matched its own experts against the
    // saved groups. Ranks that decided differently would take the
    // hyper-parameters (and which states exist) from different places.
    const auto verdicts =
        groups_->all_gather_among_writers(same_grouping ? "1" : "0", "checkpoint_grouping");
    const auto matching = std::count(verdicts.begin(), verdicts.end(), "1");
    TORCH_CHECK_VALUE(
        matching == 0 || matching == static_cast<int64_t>(verdicts.size()), "checkpoint ", path,
        ": its parameter groups match this optimizer's on ", matching, " of ", verdicts.size(),
        " ranks only (a group's parameters on one rank are in another saved group); group the "
        "parameters on every rank as they were grouped when saved; nothing was loaded");
  }
  // Every saved parameter must be held by some rank (the check the matching
  // left to here): the same verdict on every rank, as every rank read the
  // same index.
  std::unordered_map<std::string, bool> anywhere;
  for (const std::string& each :
       groups_->all_gather_among_writers(json(reader.held()).dump(), "checkpoint_held")) {
    for (const auto& name : json::parse(each)) {
      anywhere[name.get<std::string>()] = true;
    }
  }
  std::vector<std::string> missing;
  for (const auto& param : reader.index().at("params")) {
    if (!anywhere.count(param.at("name").get<std::string>())) {
      missing.push_back(param.at("name").get<std::string>());
    }
  }
  TORCH_CHECK_VALUE(missing.empty(), "checkpoint ", path, " is of another model: ", missing.size(),
                    " saved parameters are held by no rank, first '",
                    missing.empty() ? "" : missing[0], "'; nothing was loaded");
}

}  // namespace zeroshard
