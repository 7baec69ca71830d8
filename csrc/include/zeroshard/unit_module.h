// Stage 3 for torch::nn models. torch::nn::Module has no forward hooks, so the
// submodules whose parameters are gathered together are wrapped in a
// UnitModule, which gathers them around each forward call and arranges the
// gather before its backward, exactly as the Python module hooks do:
//
//   struct NetImpl : torch::nn::Module {
//     NetImpl()
//         : fc1(register_module("fc1", zeroshard::make_unit(torch::nn::Linear(8, 16)))),
//           ...
//     zeroshard::UnitModule<torch::nn::Linear> fc1;
//   };
//   Net net;
//   zeroshard::ZeroOptimizer optimizer(net->parameters(), pg, torch::optim::AdamWOptions(1e-3),
//                                      zeroshard::ZeroOptions().stage(3),
//                                      zeroshard::collect_units(*net));
//   zeroshard::attach_units(*net, optimizer);
//
// An existing model can be converted with replace_module(name, make_unit(child))
// when its forward calls the child through the registered name (containers
// such as torch::nn::ModuleDict do). Parameters outside every UnitModule stay
// gathered (persistent), like parameters below
// stage3_param_persistence_threshold.
//
// For forwards that are not one module call, UnitScope does the same around
// any code: { UnitScope scope(optimizer, unit); y = scope.track(f(x)); }.
#pragma once

#include "zeroshard/zero_optimizer.h"

#include <c10/util/Logging.h>
#include <torch/csrc/api/include/torch/nn/module.h>

#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

// RAII: gathers `unit` for the scope's lifetime (pre-forward on entry,
// post-forward on exit); track() makes the backward of an output gather the
// unit first.
class UnitScope {
 public:
  UnitScope(ZeroOptimizer& optimizer, int64_t unit) : optimizer_(optimizer), unit_(unit) {
    optimizer_.unit_pre_forward(unit_);
  }
  // A destructor must not throw (it may run while an exception unwinds).
  ~UnitScope() {
    try {
      optimizer_.unit_post_forward(unit_);
    } catch (const std::exception& e) {
      LOG(ERROR) << "zeroshard::UnitScope: releasing unit " << unit_ << " failed: " << e.what();
    }
  }
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;

  at::Tensor track(at::Tensor output) {
    optimizer_.unit_track_output(unit_, output);
    return output;
  }

 private:
  ZeroOptimizer& optimizer_;
  int64_t unit_;
};

// RAII around the model's whole forward: on exit every rank waits until
// every rank's forward returned, serving the others' gathers meanwhile (see
// ZeroOptimizer::model_forward_begin). Stage 3 trains correctly without it;
// it is needed when ranks run different units (data-dependent modules) and
// the program issues collectives of its own between forward and backward.
//   { zeroshard::ModelForward forward(optimizer); loss = net->forward(x); }
class ModelForward {
 public:
  explicit ModelForward(ZeroOptimizer& optimizer)
      : optimizer_(optimizer), exceptions_(std::uncaught_exceptions()) {
    optimizer_.model_forward_begin();
  }
  // Throws the agreement's error (ranks at different points: every rank
  // raises it) unless an exception is already unwinding the forward, where
  // it is logged: the first error is the one the caller sees.
  ~ModelForward() noexcept(false) {
    const bool raised = std::uncaught_exceptions() > exceptions_;
    if (!raised) {
      optimizer_.model_forward_end(/*raised=*/false);
      return;
    }
    try {
      optimizer_.model_forward_end(/*raised=*/true);
    } catch (const std::exception& e) {
      LOG(ERROR) << "zeroshard::ModelForward: the end-of-forward agreement failed: " << e.what();
    }
  }
  ModelForward(const ModelForward&) = delete;
  ModelForward& operator=(const ModelForward&) = delete;

 private:
  ZeroOptimizer& optimizer_;
  int exceptions_;
};

// What collect_units/attach_units see of every UnitModule.
class UnitModuleBase : public torch::nn::Module {
 public:
  void attach(ZeroOptimizer* optimizer, int64_t unit) {
    optimizer_ = optimizer;
    unit_ = unit;
  }

 protected:
  ZeroOptimizer* optimizer_ = nullptr;  // set by attach_units; must outlive forward calls
  int64_t unit_ = -1;
};

template <typename Holder>
class UnitModuleImpl : public UnitModuleBase {
 public:
  explicit UnitModuleImpl(Holder inner) : inner_(register_module("inner", std::move(inner))) {}

  // Before attach_units (e.g. a single-process reference model) this is the
  // inner module's forward. A sharded model that was not attached fails in its
  // first op on a released parameter ("... storage of size 0").
  template <typename... Args>
  auto forward(Args&&... args) {
    if (optimizer_ == nullptr) {
      return inner_->forward(std::forward<Args>(args)...);
    }
    UnitScope scope(*optimizer_, unit_);
    auto output = inner_->forward(std::forward<Args>(args)...);
    return scope.track(std::move(output));
  }

  Holder& inner() { return inner_; }

 private:
  Holder inner_;
};

template <typename Holder>
using UnitModule = std::shared_ptr<UnitModuleImpl<Holder>>;

template <typename Holder>
UnitModule<Holder> make_unit(Holder inner) {
  return std::make_shared<UnitModuleImpl<Holder>>(std::move(inner));
}

// The units of `model`: one per UnitModule (named by its path), with every
// parameter under it. Pass them to the stage 3 ZeroOptimizer.
std::vector<ParameterUnit> collect_units(torch::nn::Module& model);
// Connects every UnitModule under `model` to the optimizer built from
// collect_units(model). Collective: also gives every rank broadcast_from_rank's
// buffers of `model` (ZeroOptimizer::broadcast_buffers), as DDP does.
void attach_units(torch::nn::Module& model, ZeroOptimizer& optimizer);

}  // namespace zeroshard
