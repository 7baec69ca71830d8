// The inner optimizers' math on flat fp32 shards. Each function mirrors the
// single-tensor path of the matching torch.optim optimizer operation for
// operation, so a shard updated here equals the same elements updated by
// torch.optim (the CPU default is the single-tensor path).
//
// Knows nothing of ranks, layouts or hooks.
#pragma once

#include "zeroshard/host_optimizer_kernel.h"
#include "zeroshard/optimizer_states.h"
#include "zeroshard/shard_chunk.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

// kRule: an UpdateRule of the user's behind RuleOptions (update_rule.h);
// every other function here answers for it through the rule.
enum class InnerOptimizerKind { kAdam, kAdamW, kSGD, kRule };

const char* inner_optimizer_name(InnerOptimizerKind kind);
// What checkpoints and messages call the rule of `options`: the built-in
// kind's name, or an UpdateRule's own name.
std::string update_rule_name(InnerOptimizerKind kind,
                             const torch::optim::OptimizerOptions& options);
// Accepts "adam", "adamw", "sgd" in any case; throws naming the valid names.
InnerOptimizerKind parse_inner_optimizer(const std::string& name);
// Which kind a LibTorch options object is (AdamOptions, AdamWOptions,
// SGDOptions, RuleOptions); throws for any other options type.
InnerOptimizerKind inner_optimizer_kind_of(const torch::optim::OptimizerOptions& options);
// Throws, naming the value, if the hyper-parameters are out of range.
void validate_inner_options(InnerOptimizerKind kind, const torch::optim::OptimizerOptions& options);

// The states this kind with these options keeps beside the fp32 master, in
// OptimizerStateName order: Adam/AdamW exp_avg, exp_avg_sq, and
// max_exp_avg_sq with amsgrad; SGD a momentum buffer when momentum != 0. The
// one answer to "which states, how many" for the shards, the offloaded
// storage, checkpoints and the memory estimator.
std::vector<OptimizerStateName> inner_optimizer_states(
    InnerOptimizerKind kind, const torch::optim::OptimizerOptions& options);
// Its size: fp32 state tensors per element beside the master.
int64_t optimizer_state_count(InnerOptimizerKind kind,
                              const torch::optim::OptimizerOptions& options);
// Whether `state` is one of them (the master is not).
bool inner_optimizer_uses_state(InnerOptimizerKind kind,
                                const torch::optim::OptimizerOptions& options,
                                OptimizerStateName state);

// One contiguous run of a shard whose parameters share a step count.
struct ShardView {
  at::Tensor param;            // fp32 master values, updated in place
  at::Tensor grad;             // fp32, same shape
  at::Tensor exp_avg;          // Adam/AdamW
  at::Tensor exp_avg_sq;       // Adam/AdamW
  at::Tensor max_exp_avg_sq;   // Adam/AdamW with amsgrad
  at::Tensor momentum_buffer;  // SGD with momentum
};

// Applies one update of a built-in kind (a rule's update takes the pieces of
// its parameters: UpdateRule::update). `step` is the step count after
// incrementing (1 on the first update of these elements). `fused` uses
// ATen's fused Adam/AdamW kernel, as torch.optim's fused=True (Adam and
// AdamW only).
void apply_inner_update(InnerOptimizerKind kind, const torch::optim::OptimizerOptions& options,
                        ShardView& view, int64_t step, bool fused = false);

// The hyper-parameters of `options` as host kernel arguments (data pointers
// and sizes left unset): the offloaded step runs the same math through
// host_optimizer_kernel.h.
HostAdamArgs host_adam_args(InnerOptimizerKind kind, const torch::optim::OptimizerOptions& options);
HostSgdArgs host_sgd_args(const torch::optim::OptimizerOptions& options);

// torch.optim's defaults of each inner optimizer's hyper-parameters, the one
// statement of them: LibTorch's own options (AdamOptions, AdamWOptions: lr
// 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0 and 1e-2), and for SGD,
// whose LibTorch options have no default lr, torch.optim.SGD's. The Python
// layer (zeroshard._C.inner_optimizer_defaults) and the DeepSpeed config
// reader read them here.
constexpr double kSgdDefaultLr = 1e-3;
std::unique_ptr<torch::optim::OptimizerOptions> default_inner_options(InnerOptimizerKind kind);
// The same as JSON (inner_options_to_json's names).
nlohmann::json inner_optimizer_defaults(InnerOptimizerKind kind);

// The hyper-parameters of `options` as JSON, with torch.optim's names (lr,
// betas, eps, weight_decay, amsgrad; lr, momentum, dampening, weight_decay,
// nesterov), and back: what checkpoints store per parameter group.
nlohmann::json inner_options_to_json(InnerOptimizerKind kind,
                                     const torch::optim::OptimizerOptions& options);
void apply_inner_options_json(InnerOptimizerKind kind, torch::optim::OptimizerOptions& options,
                              const nlohmann::json& values);

}  // namespace zeroshard
