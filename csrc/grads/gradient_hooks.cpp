#include "zeroshard/gradient_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace zeroshard {
namespace {

class PostAccumulateHook : public torch::autograd::FunctionPostHook {
 public:
  explicit PostAccumulateHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

GradientHooks::GradientHooks(const std::vector<std::vector<at::Tensor>>& params,
                             GradientCallback on_gradient,
                             std::function<void(bool)> on_backward_end)
    : on_gradient_(std::move(on_gradient)), on_backward_end_(std::move(on_backward_end)) {
  hooked_.resize(params.size());
  for (size_t g = 0; g < params.size(); ++g) {
    hooked_[g].assign(params[g].size(), false);
    for (size_t i = 0; i < params[g].size(); ++i) {
      install(g, static_cast<int64_t>(i), params[g][i]);
    }
  }
}

bool GradientHooks::install(size_t group, int64_t index, const at::Tensor& param) {
  // A frozen parameter has no grad accumulator and never receives a gradient.
  if (!param.requires_grad() || hooked_[group][index]) {
    return false;
  }
  Installed hook;
  hook.accumulator = torch::autograd::impl::grad_accumulator(param);
  TORCH_INTERNAL_ASSERT(hook.accumulator, "a leaf parameter has no grad accumulator");
  // The accumulator already owns the variable, so capturing it here adds
  // no reference cycle.
  at::Tensor captured = param;
  hook.key = hook.accumulator->add_post_hook(std::make_unique<PostAccumulateHook>(
      [this, group, index, captured]() { fired(group, index, captured); }));
  installed_.push_back(std::move(hook));
  hooked_[group][index] = true;
  return true;
}

GradientHooks::~GradientHooks() {
  for (auto& hook : installed_) {
    hook.accumulator->del_post_hook(hook.key);
  }
}

void GradientHooks::track_current_backward() {
  const int graph_task = torch::autograd::get_current_graph_task_id();
  bool first_in_task = false;
  {
    std::lock_guard<std::mutex> lock(queued_mutex_);
    first_in_task = queued_graph_tasks_.insert(graph_task).second;
  }
  if (first_in_task) {
    torch::autograd::Engine::get_default_engine().queue_callback([this, graph_task]() {
      bool outermost = false;
      {
        std::lock_guard<std::mutex> lock(queued_mutex_);
        queued_graph_tasks_.erase(graph_task);
        outermost = queued_graph_tasks_.empty();
      }
      on_backward_end_(outermost);
    });
  }
}

void GradientHooks::fired(size_t group, int64_t index, const at::Tensor& param) {
  track_current_backward();
  on_gradient_(group, index, param);
}

}  // namespace zeroshard
