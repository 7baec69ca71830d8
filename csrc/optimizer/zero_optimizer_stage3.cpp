// ZeroOptimizer: stage 3 unit hooks, gathering on demand, partitioned
// construction, full parameters, and the parameter byte counters.
#include "zero_optimizer_impl.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cmath>
#include <functional>
#include <unordered_map>

namespace zeroshard {

namespace {

// [Note: writes outside the step]
// Outside step() a modified or initialized parameter is written bucket by
// bucket between broadcasts. With NVMe swap space a write can fail on one
// rank (a full or failing disk): that rank stops writing but goes on with the
// broadcasts, and after the loop every rank raises the error (as the step
// does) instead of leaving the others to wait in the next collective until
// the process group times out.
void write_unless_failed(bool keep_error, std::string& error, const std::function<void()>& write) {
  if (!error.empty()) {
    return;
  }
  if (!keep_error) {
    write();  // no I/O: nothing rank-specific can fail
    return;
  }
  try {
    write();
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
}

}  // namespace

void ZeroOptimizer::Impl::raise_agreed_write_error(std::string error, const std::string& what) {
  if (!swaps_to_nvme()) {
    return;
  }
  write_unless_failed(true, error, [this] {
    if (param_swapper_) {
      param_swapper_->flush();
    }
  });
  const std::string agreed = groups_->agree(error, "nvme_write");
  TORCH_CHECK(agreed.empty(), "could not write ", what,
              " to the NVMe swap space (they are partly written; resume from the last "
              "checkpoint): ",
              agreed);
}

std::vector<std::vector<at::Tensor>> ZeroOptimizer::Impl::full_parameters(int64_t rank) {
  check_groups_fixed();
  TORCH_CHECK_VALUE(rank >= 0 && rank < groups_->shard().world_size(), "rank must be in [0, ",
                    groups_->shard().world_size(), "), got ", rank);
  std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
  at::NoGradGuard no_grad;
  std::vector<std::vector<at::Tensor>> out(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const GroupLayout& layout = layout_->group(g);
    const auto& params = param_groups_[g].params();
    if (groups_->shard().rank() == rank) {
      for (const auto& param : params) {
        out[g].push_back(at::zeros(param.sizes(), fp32_options()));
      }
    }
    for (size_t b = 0; b < layout.buckets().size(); ++b) {
      const Bucket& bucket = layout.buckets()[b];
      at::Tensor input = read_master(g, bucket.shard_offset, bucket.shard_numel);
      at::Tensor full = at::empty({bucket.numel}, fp32_options());
      groups_->shard().all_gather(full, input, "full_parameters/" + bucket_tag(g, b)).wait();
      if (groups_->shard().rank() != rank) {
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

int64_t ZeroOptimizer::Impl::num_units() const { return gatherer_ ? gatherer_->num_units() : 0; }

int64_t ZeroOptimizer::Impl::unit_index(const std::string& name) const {
  for (int64_t u = 0; u < num_units(); ++u) {
    if (gatherer_->unit_name(u) == name) {
      return u;
    }
  }
  TORCH_CHECK_INDEX(false, "no unit named '", name, "'");
}

void ZeroOptimizer::Impl::unit_pre_forward(int64_t unit) {
  TORCH_CHECK(gatherer_, "unit hooks need stage 3");
  std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
  at::NoGradGuard no_grad;
  // A forward inside a backward pass is an activation-checkpoint recompute.
  const bool in_backward = torch::autograd::get_current_graph_task_id() != -1;
  if (in_backward) {
    gradients_->track_current_backward();
  }
  gatherer_->pre_forward(unit, in_backward);
}

void ZeroOptimizer::Impl::unit_post_forward(int64_t unit) {
  TORCH_CHECK(gatherer_, "unit hooks need stage 3");
  std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
  gatherer_->post_forward(unit, torch::autograd::get_current_graph_task_id() != -1);
}

void ZeroOptimizer::Impl::unit_track_output(int64_t unit, const at::Tensor& output) {
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
    // Autograd runs a backward with grad mode on only with create_graph.
    const bool create_graph = at::GradMode::is_enabled();
    std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
    Communicator::CallScope call(communicator(), "backward");
    at::NoGradGuard no_grad;
    gradients_->track_current_backward();
    gradients_->follow_requires_grad(/*outside_backward=*/false);
    gatherer_->pre_backward(unit, create_graph);
  });
}

void ZeroOptimizer::Impl::model_forward_begin() {
  if (gatherer_ && torch::autograd::get_current_graph_task_id() == -1) {
    model_forward_depth_ += 1;
    gradients_->follow_requires_grad(/*outside_backward=*/true);
  }
}

void ZeroOptimizer::Impl::model_forward_end(bool raised) {
  if (!gatherer_ || torch::autograd::get_current_graph_task_id() != -1 ||
      model_forward_depth_ == 0) {
    return;
  }
  model_forward_depth_ -= 1;
  if (model_forward_depth_ > 0 || raised) {
    return;
  }
  std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
  at::NoGradGuard no_grad;
  gatherer_->wait_for_all_ranks(AgreementBarrier::kForwardEnd);
}

int64_t ZeroOptimizer::Impl::agreements() const {
  return gatherer_ && gatherer_->agreement() ? gatherer_->agreement()->agreements() : 0;
}

int64_t ZeroOptimizer::Impl::diverged_agreements() const {
  return gatherer_ && gatherer_->agreement() ? gatherer_->agreement()->count_rounds() : 0;
}

void ZeroOptimizer::Impl::pin_parameters(const std::vector<at::Tensor>& params) {
  if (!gatherer_) {
    return;  // stages 1 and 2: always gathered
  }
  std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
  at::NoGradGuard no_grad;
  gatherer_->pin(buckets_of(params));
}

void ZeroOptimizer::Impl::unpin_parameters(const std::vector<at::Tensor>& params,
                                           int64_t modifier_rank) {
  TORCH_CHECK_VALUE(modifier_rank < groups_->shard().world_size(),
                    "modifier_rank must be < world size ", groups_->shard().world_size(), ", got ",
                    modifier_rank);
  std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
  at::NoGradGuard no_grad;
  const std::vector<BucketId> buckets = buckets_of(params);
  std::string write_error;  // see [Note: writes outside the step]
  if (modifier_rank >= 0) {
    for (const auto& [g, b] : buckets) {
      const Bucket& bucket = layout_->group(g).buckets()[b];
      at::Tensor full = gatherer_
                            ? gatherer_->full(g, b)
                            : buffers_[g].flat_param.narrow(0, bucket.flat_offset, bucket.numel);
      groups_->shard().broadcast(full, modifier_rank, "modified/" + bucket_tag(g, b));
      // Hybrid sharding: modifier_rank of the first replica decides.
      groups_->broadcast_across_replicas(full, "modified/" + bucket_tag(g, b));
      at::Tensor mine =
          full.narrow(0, groups_->shard().rank() * bucket.shard_numel, bucket.shard_numel);
      write_unless_failed(swaps_to_nvme(), write_error, [&, g = g] {
        write_master(g, bucket.shard_offset, mine);
        if (param_swapper_) {
          param_swapper_->write(g, bucket.shard_offset, mine);
        } else if (buffers_[g].param_shard.defined()) {
          buffers_[g].param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel).copy_(mine);
        }
      });
    }
  }
  if (gatherer_) {
    gatherer_->unpin(buckets);
  }
  if (modifier_rank >= 0) {
    raise_agreed_write_error(std::move(write_error), "the modified parameters");
  }
}

void ZeroOptimizer::Impl::adopt_parameters(const std::vector<std::vector<at::Tensor>>& params) {
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
  param_index_.rebuild(param_groups_);
  gradients_->expect_current_gradients();
  if (gradients_->uses_hooks()) {
    gradients_->install_hooks();
  }
}

void ZeroOptimizer::Impl::begin_initialization(const std::vector<at::Tensor>& params) {
  TORCH_CHECK(gatherer_, "begin_initialization is for stage 3 partitioned construction");
  std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
  at::NoGradGuard no_grad;
  gatherer_->pin_for_initialization(buckets_of(params));
}

void ZeroOptimizer::Impl::end_initialization(const std::vector<at::Tensor>& params) {
  TORCH_CHECK(gatherer_, "end_initialization is for stage 3 partitioned construction");
  std::lock_guard<std::recursive_mutex> lock(gradients_->mutex());
  at::NoGradGuard no_grad;
  const std::vector<BucketId> buckets = buckets_of(params);
  std::string write_error;  // see [Note: writes outside the step]
  for (const auto& [g, b] : buckets) {
    const Bucket& bucket = layout_->group(g).buckets()[b];
    // Hybrid sharding: the first replica's initial values, whatever the
    // other replicas' random generators produced.
    groups_->broadcast_across_replicas(gatherer_->full(g, b), "initialized/" + bucket_tag(g, b));
    at::Tensor mine = gatherer_->full(g, b).narrow(0, groups_->shard().rank() * bucket.shard_numel,
                                                   bucket.shard_numel);
    write_unless_failed(swaps_to_nvme(), write_error, [&, g = g] {
      if (param_swapper_) {
        param_swapper_->write(g, bucket.shard_offset, mine);
      } else {
        buffers_[g].param_shard.narrow(0, bucket.shard_offset, bucket.shard_numel).copy_(mine);
      }
      if (buffers_[g].state(OptimizerStateName::kMaster).defined() || offloaded_) {
        write_master(g, bucket.shard_offset, mine);
      }
    });
  }
  gatherer_->unpin(buckets);
  raise_agreed_write_error(std::move(write_error), "the initialized parameters");
}

void ZeroOptimizer::Impl::finish_initialization(const std::string& local_error) {
  TORCH_CHECK(gatherer_, "finish_initialization is for stage 3 partitioned construction");
  const std::string agreed = groups_->agree(local_error, "initialization");
  TORCH_CHECK_VALUE(agreed.empty(), "partitioned construction: initializing the parameters failed ",
                    agreed,
                    "; fix the initializer (param_init_fn or reset_parameters) and construct "
                    "again");
}

int64_t ZeroOptimizer::Impl::parameter_bytes() const {
  int64_t bytes = gathered_parameter_bytes();
  if (param_swapper_) {  // what stays in host memory; the rest is on disk
    bytes += param_swapper_->host_shard_bytes() + param_swapper_->ahead_bytes();
  }
  for (const auto& shard : buffers_) {
    if (shard.param_shard.defined()) {
      bytes += shard.param_shard.numel() * static_cast<int64_t>(shard.param_shard.element_size());
    }
  }
  return bytes;
}

int64_t ZeroOptimizer::Impl::gathered_parameter_bytes() const {
  if (gatherer_) {
    return gatherer_->live_bytes();
  }
  int64_t bytes = 0;
  for (const auto& shard : buffers_) {
    bytes += shard.flat_param.numel() * static_cast<int64_t>(shard.flat_param.element_size());
  }
  return bytes;
}

int64_t ZeroOptimizer::Impl::peak_gathered_parameter_bytes() const {
  return gatherer_ ? gatherer_->peak_live_bytes() : gathered_parameter_bytes();
}

void ZeroOptimizer::Impl::reset_peak_gathered_parameter_bytes() {
  if (gatherer_) {
    gatherer_->reset_peak_live_bytes();
  }
}

}  // namespace zeroshard
