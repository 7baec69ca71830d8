#include "zeroshard/inner_optimizer.h"

#include "zeroshard/text.h"
#include "zeroshard/update_rule.h"

#include <ATen/Parallel.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/sqrt.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace zeroshard {
namespace {

struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, decoupled;
};

AdamHyper adam_hyper(InnerOptimizerKind kind, const torch::optim::OptimizerOptions& o) {
  if (kind == InnerOptimizerKind::kAdamW) {
    const auto& w = static_cast<const torch::optim::AdamWOptions&>(o);
    return {w.lr(),  std::get<0>(w.betas()), std::get<1>(w.betas()),
            w.eps(), w.weight_decay(),       w.amsgrad(),
            true};
  }
  const auto& a = static_cast<const torch::optim::AdamOptions&>(o);
  return {a.lr(),  std::get<0>(a.betas()), std::get<1>(a.betas()),
          a.eps(), a.weight_decay(),       a.amsgrad(),
          false};
}

// [Note: cache-sized update chunks]
// torch.optim's single-tensor Adam is a chain of elementwise ops, each a full
// pass over its tensors with a fresh temporary for the denominator. On a
// flat shard of millions of elements every pass streams from memory and every
// temporary is a new mapping whose pages fault in: 78 ms for 14.7M elements
// on one core, where the fused kernel takes 7 (timed once, outside the repo;
// test_inner_update.py checks the values). The same ops over pieces that
// fit in L2, with the temporaries in one reused scratch buffer, run the same
// arithmetic on every element (the results are equal), a piece per thread.
// CUDA tensors keep whole-tensor ops: there, pieces would only add launches.
constexpr int64_t kUpdatePiece = 32768;  // elements: 5 tensors of it fit in L2

// The pieces of `numel` elements, a range of them per thread, each thread
// with `scratch_count` reused buffers of one piece.
template <typename PieceFn>
void for_each_update_piece(const at::Tensor& like, int scratch_count, const PieceFn& fn) {
  const int64_t numel = like.numel();
  if (!like.is_cpu() || numel <= kUpdatePiece) {
    std::vector<at::Tensor> scratch;
    for (int i = 0; i < scratch_count; ++i) {
      scratch.push_back(at::empty_like(like));
    }
    fn(0, numel, scratch);
    return;
  }
  const int64_t pieces = (numel + kUpdatePiece - 1) / kUpdatePiece;
  at::parallel_for(0, pieces, 1, [&](int64_t first, int64_t last) {
    std::vector<at::Tensor> scratch;
    for (int i = 0; i < scratch_count; ++i) {
      scratch.push_back(at::empty({kUpdatePiece}, like.options()));
    }
    for (int64_t piece = first; piece < last; ++piece) {
      const int64_t offset = piece * kUpdatePiece;
      const int64_t length = std::min(kUpdatePiece, numel - offset);
      std::vector<at::Tensor> slices;
      for (const auto& t : scratch) {
        slices.push_back(t.narrow(0, 0, length));
      }
      fn(offset, length, slices);
    }
  });
}

// Mirrors torch.optim.adam._single_tensor_adam (not capturable, not
// differentiable, not maximize), op for op, over pieces.
void adam_update(const AdamHyper& h, ShardView& v, int64_t step) {
  // torch.optim reads the step from a float32 tensor and does the bias
  // corrections in Python floats (double).
  const double step_value = static_cast<double>(static_cast<float>(step));
  const double bias_correction1 = 1 - std::pow(h.beta1, step_value);
  const double bias_correction2 = 1 - std::pow(h.beta2, step_value);
  const double step_size = h.lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  const bool l2 = h.weight_decay != 0 && !h.decoupled;
  for_each_update_piece(v.param, l2 ? 2 : 1,
                        [&](int64_t offset, int64_t length, std::vector<at::Tensor>& scratch) {
                          at::Tensor param = v.param.narrow(0, offset, length);
                          at::Tensor exp_avg = v.exp_avg.narrow(0, offset, length);
                          at::Tensor exp_avg_sq = v.exp_avg_sq.narrow(0, offset, length);
                          at::Tensor grad = v.grad.narrow(0, offset, length);
                          if (h.weight_decay != 0) {
                            if (h.decoupled) {
                              param.mul_(1 - h.lr * h.weight_decay);
                            } else {
                              grad = at::add_out(scratch[1], grad, param, h.weight_decay);
                            }
                          }
                          exp_avg.lerp_(grad, 1 - h.beta1);
                          exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, 1 - h.beta2);
                          at::Tensor denom = scratch[0];
                          if (h.amsgrad) {
                            at::Tensor max_exp_avg_sq = v.max_exp_avg_sq.narrow(0, offset, length);
                            at::maximum_out(max_exp_avg_sq, max_exp_avg_sq, exp_avg_sq);
                            at::sqrt_out(denom, max_exp_avg_sq);
                          } else {
                            at::sqrt_out(denom, exp_avg_sq);
                          }
                          denom.div_(bias_correction2_sqrt).add_(h.eps);
                          param.addcdiv_(exp_avg, denom, -step_size);
                        });
}

// Mirrors torch.optim.adam._fused_adam: one kernel per update.
void fused_adam_update(const AdamHyper& h, ShardView& v, int64_t step) {
  at::Tensor step_tensor = at::full({}, static_cast<double>(step), v.param.options());
  std::vector<at::Tensor> max_exp_avg_sqs;
  if (h.amsgrad) {
    max_exp_avg_sqs.push_back(v.max_exp_avg_sq);
  }
  if (h.decoupled) {
    at::_fused_adamw_({v.param}, {v.grad}, {v.exp_avg}, {v.exp_avg_sq}, max_exp_avg_sqs,
                      {step_tensor}, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad,
                      /*maximize=*/false);
  } else {
    at::_fused_adam_({v.param}, {v.grad}, {v.exp_avg}, {v.exp_avg_sq}, max_exp_avg_sqs,
                     {step_tensor}, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad,
                     /*maximize=*/false);
  }
}

// Mirrors torch.optim.sgd._single_tensor_sgd (not maximize), op for op, over
// pieces (see [Note: cache-sized update chunks]).
void sgd_update(const torch::optim::SGDOptions& o, ShardView& v, int64_t step) {
  const bool l2 = o.weight_decay() != 0;
  const bool nesterov = o.momentum() != 0 && o.nesterov();
  for_each_update_piece(v.param, (l2 ? 1 : 0) + (nesterov ? 1 : 0),
                        [&](int64_t offset, int64_t length, std::vector<at::Tensor>& scratch) {
                          at::Tensor param = v.param.narrow(0, offset, length);
                          at::Tensor grad = v.grad.narrow(0, offset, length);
                          if (l2) {
                            grad = at::add_out(scratch[0], grad, param, o.weight_decay());
                          }
                          if (o.momentum() != 0) {
                            at::Tensor buffer = v.momentum_buffer.narrow(0, offset, length);
                            if (step == 1) {
                              // torch.optim creates the buffer as a clone of the first gradient.
                              buffer.copy_(grad);
                            } else {
                              buffer.mul_(o.momentum()).add_(grad, 1 - o.dampening());
                            }
                            if (nesterov) {
                              grad = at::add_out(scratch.back(), grad, buffer, o.momentum());
                            } else {
                              grad = buffer;
                            }
                          }
                          param.add_(grad, -o.lr());
                        });
}

}  // namespace

const char* inner_optimizer_name(InnerOptimizerKind kind) {
  switch (kind) {
    case InnerOptimizerKind::kAdam:
      return "adam";
    case InnerOptimizerKind::kAdamW:
      return "adamw";
    case InnerOptimizerKind::kSGD:
      return "sgd";
    case InnerOptimizerKind::kRule:
      return "rule";
  }
  return "unknown";
}

std::string update_rule_name(InnerOptimizerKind kind,
                             const torch::optim::OptimizerOptions& options) {
  if (kind == InnerOptimizerKind::kRule) {
    return static_cast<const RuleOptions&>(options).rule()->name();
  }
  return inner_optimizer_name(kind);
}

InnerOptimizerKind parse_inner_optimizer(const std::string& name) {
  const std::string lower = lowercase(name);
  if (lower == "adam") {
    return InnerOptimizerKind::kAdam;
  }
  if (lower == "adamw") {
    return InnerOptimizerKind::kAdamW;
  }
  if (lower == "sgd") {
    return InnerOptimizerKind::kSGD;
  }
  TORCH_CHECK_VALUE(false, "unknown optimizer '", name,
                    "'; expected one of 'adam', 'adamw', 'sgd'");
}

InnerOptimizerKind inner_optimizer_kind_of(const torch::optim::OptimizerOptions& options) {
  if (dynamic_cast<const torch::optim::AdamWOptions*>(&options) != nullptr) {
    return InnerOptimizerKind::kAdamW;
  }
  if (dynamic_cast<const torch::optim::AdamOptions*>(&options) != nullptr) {
    return InnerOptimizerKind::kAdam;
  }
  if (dynamic_cast<const torch::optim::SGDOptions*>(&options) != nullptr) {
    return InnerOptimizerKind::kSGD;
  }
  if (dynamic_cast<const RuleOptions*>(&options) != nullptr) {
    return InnerOptimizerKind::kRule;
  }
  TORCH_CHECK_VALUE(false,
                    "unsupported inner optimizer options; zeroshard expects "
                    "torch::optim::AdamOptions, AdamWOptions, SGDOptions or "
                    "zeroshard::RuleOptions (an UpdateRule: update_rule.h)");
}

void validate_inner_options(InnerOptimizerKind kind,
                            const torch::optim::OptimizerOptions& options) {
  TORCH_CHECK_VALUE(inner_optimizer_kind_of(options) == kind, "parameter group options are not ",
                    inner_optimizer_name(kind),
                    " options; every group must use the optimizer's options type");
  if (kind == InnerOptimizerKind::kRule) {
    const auto& o = static_cast<const RuleOptions&>(options);
    o.rule()->validate(o.hyperparameters());
    return;
  }
  if (kind == InnerOptimizerKind::kSGD) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
    TORCH_CHECK_VALUE(o.lr() >= 0, "Invalid learning rate: ", o.lr(), " (expected lr >= 0)");
    TORCH_CHECK_VALUE(o.momentum() >= 0, "Invalid momentum value: ", o.momentum(),
                      " (expected momentum >= 0)");
    TORCH_CHECK_VALUE(o.weight_decay() >= 0, "Invalid weight_decay value: ", o.weight_decay(),
                      " (expected weight_decay >= 0)");
    TORCH_CHECK_VALUE(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
                      "Nesterov momentum requires a momentum > 0 and zero dampening; got "
                      "momentum ",
                      o.momentum(), ", dampening ", o.dampening());
    return;
  }
  const AdamHyper h = adam_hyper(kind, options);
  TORCH_CHECK_VALUE(h.lr >= 0, "Invalid learning rate: ", h.lr, " (expected lr >= 0)");
  TORCH_CHECK_VALUE(h.eps >= 0, "Invalid epsilon value: ", h.eps, " (expected eps >= 0)");
  TORCH_CHECK_VALUE(h.beta1 >= 0 && h.beta1 < 1, "Invalid beta parameter at index 0: ", h.beta1,
                    " (expected 0 <= beta1 < 1)");
  TORCH_CHECK_VALUE(h.beta2 >= 0 && h.beta2 < 1, "Invalid beta parameter at index 1: ", h.beta2,
                    " (expected 0 <= beta2 < 1)");
  TORCH_CHECK_VALUE(h.weight_decay >= 0, "Invalid weight_decay value: ", h.weight_decay,
                    " (expected weight_decay >= 0)");
}

std::vector<OptimizerStateName> inner_optimizer_states(
    InnerOptimizerKind kind, const torch::optim::OptimizerOptions& options) {
  if (kind == InnerOptimizerKind::kRule) {
    return rule_states(static_cast<const RuleOptions&>(options));
  }
  if (kind == InnerOptimizerKind::kSGD) {
    if (static_cast<const torch::optim::SGDOptions&>(options).momentum() != 0) {
      return {OptimizerStateName::kMomentumBuffer};
    }
    return {};
  }
  if (adam_hyper(kind, options).amsgrad) {
    return {OptimizerStateName::kExpAvg, OptimizerStateName::kExpAvgSq,
            OptimizerStateName::kMaxExpAvgSq};
  }
  return {OptimizerStateName::kExpAvg, OptimizerStateName::kExpAvgSq};
}

int64_t optimizer_state_count(InnerOptimizerKind kind,
                              const torch::optim::OptimizerOptions& options) {
  return static_cast<int64_t>(inner_optimizer_states(kind, options).size());
}

bool inner_optimizer_uses_state(InnerOptimizerKind kind,
                                const torch::optim::OptimizerOptions& options,
                                OptimizerStateName state) {
  const auto states = inner_optimizer_states(kind, options);
  return std::find(states.begin(), states.end(), state) != states.end();
}

void apply_inner_update(InnerOptimizerKind kind, const torch::optim::OptimizerOptions& options,
                        ShardView& view, int64_t step, bool fused) {
  TORCH_CHECK_VALUE(kind != InnerOptimizerKind::kRule,
                    "an update rule updates the pieces of its parameters (UpdateRule::update), "
                    "not a run of a flat shard");
  if (kind == InnerOptimizerKind::kSGD) {
    TORCH_CHECK_VALUE(!fused, "fused=True is available for Adam and AdamW, not SGD");
    sgd_update(static_cast<const torch::optim::SGDOptions&>(options), view, step);
  } else if (fused) {
    fused_adam_update(adam_hyper(kind, options), view, step);
  } else {
    adam_update(adam_hyper(kind, options), view, step);
  }
}

HostAdamArgs host_adam_args(InnerOptimizerKind kind,
                            const torch::optim::OptimizerOptions& options) {
  TORCH_CHECK_VALUE(kind == InnerOptimizerKind::kAdam || kind == InnerOptimizerKind::kAdamW,
                    "host_adam_args needs Adam or AdamW options");
  const AdamHyper h = adam_hyper(kind, options);
  HostAdamArgs args;
  args.lr = h.lr;
  args.beta1 = h.beta1;
  args.beta2 = h.beta2;
  args.eps = h.eps;
  args.weight_decay = h.weight_decay;
  args.decoupled_weight_decay = h.decoupled;
  return args;
}

HostSgdArgs host_sgd_args(const torch::optim::OptimizerOptions& options) {
  const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
  HostSgdArgs args;
  args.lr = o.lr();
  args.momentum = o.momentum();
  args.dampening = o.dampening();
  args.weight_decay = o.weight_decay();
  args.nesterov = o.nesterov();
  return args;
}

}  // namespace zeroshard
