// Autograd hooks that hand each parameter's gradient to zeroshard as soon as
// autograd has accumulated it, and call back once at the end of each backward
// pass. Installed by the C++ core on the parameters' grad accumulators (as
// DDP's reducer does), so they work the same for Python and C++ models.
//
// Thread-safety: callbacks run on the autograd thread that ran the backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

namespace zeroshard {

class GradientHooks {
 public:
  // on_gradient(group, index, param): param.grad() holds the accumulated
  // gradient. on_backward_end(outermost): after each backward pass (graph
  // task) that fired any hook or called track_current_backward(); outermost
  // is false while another such graph task is still running (the end of a
  // reentrant checkpoint's backward inside the outer one).
  using GradientCallback = std::function<void(size_t, int64_t, const at::Tensor&)>;
  GradientHooks(const std::vector<std::vector<at::Tensor>>& params, GradientCallback on_gradient,
                std::function<void(bool outermost)> on_backward_end);
  ~GradientHooks();
  GradientHooks(const GradientHooks&) = delete;
  GradientHooks& operator=(const GradientHooks&) = delete;

  // Outside a backward pass: hooks parameter `index` of `group` if it needs
  // a gradient now and has no hook yet (it was frozen when the hooks were
  // installed); returns whether it did.
  bool install(size_t group, int64_t index, const at::Tensor& param);

  // From inside a backward pass (e.g. a tensor hook): makes sure
  // on_backward_end runs when this graph task ends.
  void track_current_backward();
  // After a backward pass failed: its end callback never runs, so forget it.
  void forget_backwards() {
    std::lock_guard<std::mutex> lock(queued_mutex_);
    queued_graph_tasks_.clear();
  }

 private:
  void fired(size_t group, int64_t index, const at::Tensor& param);

  struct Installed {
    // Autograd holds grad accumulators weakly; keeping them here keeps the
    // hooks alive for the optimizer's lifetime.
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t key = 0;
  };
  std::vector<Installed> installed_;
  std::vector<std::vector<bool>> hooked_;  // per group and parameter
  GradientCallback on_gradient_;
  std::function<void(bool)> on_backward_end_;
  // Graph tasks (backward passes) with an end callback queued. A reentrant
  // backward (torch.utils.checkpoint with use_reentrant=True) runs inside the
  // outer one as its own graph task and gets its own callback.
  std::mutex queued_mutex_;
  std::unordered_set<int> queued_graph_tasks_;
};

}  // namespace zeroshard
