// Options of the ZeRO wrapper, in the LibTorch style:
//   zeroshard::ZeroOptions().stage(1).reduce_bucket_size(50'000'000)
// The inner optimizer's hyper-parameters are LibTorch's own options types
// (torch::optim::AdamWOptions, AdamOptions, SGDOptions).
#pragma once

#include "zeroshard/io_engine.h"
#include "zeroshard/offload_options.h"

#include <c10/core/Device.h>
#include <torch/csrc/api/include/torch/arg.h>

#include <cstdint>

namespace zeroshard {

struct ZeroOptions {
  // 1: optimizer state sharded; gradients reduced at step().
  // 2: gradients sharded too, reduced from autograd hooks during backward.
  // 3: parameters sharded too, gathered per unit just before use and released
  //    right after (see parameter_gatherer.h).
  TORCH_ARG(int64_t, stage) = 1;
  // Elements per gradient bucket (DeepSpeed's reduce_bucket_size). Also the
  // all-gather granularity of updated parameters. 5e6 elements (20 MB in
  // fp32, near DDP's 25 MiB) lets stage 2 overlap backward; DeepSpeed's 5e8
  // makes most models one bucket, whose reduction waits for the whole
  // backward (benchmarks/results/peers.md measures the difference).
  TORCH_ARG(int64_t, reduce_bucket_size) = 5000000;
  // Global-norm gradient clipping inside step(); 0 turns it off.
  TORCH_ARG(double, max_norm) = 0;
  // Stage 2: launch each bucket's reduce-scatter as soon as it is complete,
  // overlapping backward; false waits for the end of backward.
  TORCH_ARG(bool, overlap_comm) = true;
  // Gradient buckets whose collectives may be outstanding at once.
  TORCH_ARG(int64_t, max_buckets_in_flight) = 2;
  // Adam/AdamW through ATen's fused kernel (torch.optim's fused=True): the
  // same results as torch.optim.AdamW(fused=True), several times faster on CPU
  // than the default single-tensor path (benchmarks/results/cpu_optimizer.md).
  TORCH_ARG(bool, fused) = false;
  // 16-bit parameters: bucket and reduce gradients in fp32 (DeepSpeed's
  // communication_data_type fp32) instead of the parameters' dtype.
  TORCH_ARG(bool, reduce_in_fp32) = false;
  // Gloo has no reduce-scatter of its own: c10d emulates it with an
  // all-reduce, which moves twice the bytes of a ring reduce-scatter. With
  // this on (the default), zeroshard sends each rank its chunk with one
  // all-to-all and sums the W received chunks locally: each element crosses
  // the wire once. No effect on backends with a native reduce-scatter (NCCL).
  TORCH_ARG(bool, gloo_reduce_scatter_all_to_all) = true;
  // Gloo's all-gather receives into a buffer of its own and copies it out
  // (an allocation and a full copy per call). With this on (the default),
  // zeroshard all-gathers with one in-place broadcast per rank instead: the
  // same bytes, no copy. See [Note: an all-gather as broadcasts]. No effect on
  // NCCL.
  TORCH_ARG(bool, gloo_all_gather_broadcasts) = true;
  // Stage 1: reduce-scatter during backward from the gradient hooks (as stage
  // 2) while keeping .grad; see [Note: stage 1 overlap]. Off by default: it
  // holds the gradient shard (Psi/N) from backward to the step, beyond the
  // ZeRO-1 figure, and on 2 CPU ranks it was no faster than reducing in
  // step() (benchmarks/results/step_time_changes.md).
  TORCH_ARG(bool, stage1_reduce_in_backward) = false;
  // A step whose reduced gradients hold inf or NaN on any rank is skipped on
  // every rank (agreed in the step's one flag all-reduce): fp16 loss scaling,
  // or bf16 with a non-finite check.
  TORCH_ARG(bool, skip_nonfinite_steps) = false;
  // Rank whose initial parameter values every rank starts from.
  TORCH_ARG(int64_t, broadcast_from_rank) = 0;
  // What the summed gradients are divided by (FSDP2's gradient divide
  // factor), times the loss scale; 0: the data-parallel world size, the mean
  // over ranks. Expert parameters under expert parallelism set the whole
  // data-parallel world here while their optimizer's group is the expert
  // data-parallel one: each expert's gradient already sums the tokens its
  // expert-parallel group routed to it.
  TORCH_ARG(double, gradient_divide_factor) = 0;

  // Offload (DeepSpeed's keys and defaults; see offload_options.h). The
  // optimizer state (fp32 master and moments) and the step move to CPU
  // memory at any stage; the parameter shards at stage 3 only.
  TORCH_ARG(OffloadOptions, offload_optimizer);
  TORCH_ARG(OffloadOptions, offload_param);
  // Elements per optimizer sub-group (DeepSpeed's sub_group_size): with
  // offload, the step runs sub-group by sub-group, so copies to and from the
  // host overlap the update of the previous one and host buffers stay one
  // sub-group in size.
  TORCH_ARG(int64_t, sub_group_size) = 1000000000;
  // The NVMe tier's I/O (DeepSpeed's "aio" section; see io_engine.h).
  TORCH_ARG(AioOptions, aio);

  // Stage 3 (DeepSpeed's keys and defaults). Elements of parameters the
  // prefetch may gather ahead of the unit running now.
  TORCH_ARG(int64_t, stage3_prefetch_bucket_size) = 50000000;
  // Parameters with fewer elements stay gathered (biases, norms): gathering
  // them costs more latency than the memory they would free.
  TORCH_ARG(int64_t, stage3_param_persistence_threshold) = 100000;
  // Gathered elements beyond which prefetching stops (a unit needed now is
  // always gathered).
  TORCH_ARG(int64_t, stage3_max_live_parameters) = 1000000000;
  // Stage 3: ranks agree on each gather and gradient reduction before
  // issuing it, so they may run different modules ([Note: Negotiated
  // collectives] in collective_agreement.h), and compare every other
  // collective, so a real divergence raises instead of hanging ([Note:
  // Collective order check] in communicator.h). One 16-byte all-reduce per
  // agreement and per other collective. False: every rank must run the same
  // modules in the same order.
  TORCH_ARG(bool, check_collective_order) = true;
  // Stage 3: where parameters constructed on the meta device are
  // materialized (partitioned construction).
  TORCH_ARG(c10::Device, materialize_device) = c10::Device(c10::kCPU);
};

// [Note: one list of the scalar options]
// The scalar options above (numbers and flags), by name, once, with what
// every reader of them needs:
//   X(name, DeepSpeed zero_optimization key or "", its older spelling or "",
//     least value accepted, that rule as the error message says it or "" for
//     no range, a one-line description for users)
// The Python binding reads keyword arguments through it and exports the
// defaults and descriptions (zeroshard._C.zero_option_defaults() and
// zero_option_docs(): the Python signature and docstring use them); the
// DeepSpeed config reader reads the keys and bounds; validate_zero_options
// checks the rules. So a scalar option is declared by its TORCH_ARG above
// and one line here; tests check that the Python signature and docstring
// agree. The structured options (offload_optimizer, offload_param, aio,
// materialize_device) have readers of their own; the stage (which may be
// "auto" in a config, and whose message lists the stages) its own check.
#define ZEROSHARD_SCALAR_ZERO_OPTIONS(X)                                                         \
  X(stage, "", "", 1, "",                                                                        \
    "ZeRO stage. 1 shards the optimizer state; gradients are averaged inside step(). 2 also "    \
    "shards the gradients: autograd hooks reduce-scatter them bucket by bucket during backward " \
    "and release each parameter's .grad, so after backward each rank holds only its gradient "   \
    "shard. 3 also shards the parameters: a unit's parameters are all-gathered just before its " \
    "forward and backward and freed right after (Python: needs module=)")                        \
  X(reduce_bucket_size, "reduce_bucket_size", "", 1, ">= 1 element",                             \
    "elements per gradient bucket (DeepSpeed's key; the default 5e6 lets stage 2 overlap "       \
    "backward, where DeepSpeed's 5e8 makes most models a single bucket); also the all-gather "   \
    "granularity of updated parameters")                                                         \
  X(max_norm, "", "", 0, ">= 0 (0 turns clipping off)",                                          \
    "clip gradients to this global L2 norm inside step(); 0 (Python: None) turns clipping "      \
    "off; see also clip_grad_norm_")                                                             \
  X(overlap_comm, "overlap_comm", "", 0, "",                                                     \
    "stage 2 launches each bucket's reduce-scatter as soon as it is complete, during "           \
    "backward; false waits for the end of backward")                                             \
  X(max_buckets_in_flight, "", "", 1, ">= 1",                                                    \
    "gradient buckets whose collectives may be outstanding at once (bounds staging memory)")     \
  X(fused, "", "", 0, "",                                                                        \
    "Adam/AdamW through ATen's fused kernel, as torch.optim's fused=True (the same results; "    \
    "several times faster on CPU than the default path)")                                        \
  X(reduce_in_fp32, "", "", 0, "", "16-bit parameters: bucket and reduce gradients in fp32")     \
  X(gloo_reduce_scatter_all_to_all, "", "", 0, "",                                               \
    "on Gloo (no native reduce-scatter), reduce-scatter with one all-to-all and a local sum, "   \
    "moving each element once, instead of c10d's all-reduce emulation (twice the bytes). No "    \
    "effect on NCCL")                                                                            \
  X(gloo_all_gather_broadcasts, "", "", 0, "",                                                   \
    "on Gloo, all-gather parameters with one in-place broadcast per rank instead of Gloo's "     \
    "allgather, which receives into a buffer of its own and copies it out. No effect on NCCL")   \
  X(stage1_reduce_in_backward, "", "", 0, "",                                                    \
    "stage 1 reduce-scatters during backward (with overlap_comm) while keeping .grad; holds "    \
    "the gradient shard from backward to the step. Off by default")                              \
  X(skip_nonfinite_steps, "", "", 0, "",                                                         \
    "a step whose gradients hold inf/NaN on any rank is skipped on every rank (see "             \
    "last_step_skipped())")                                                                      \
  X(broadcast_from_rank, "", "", 0, "", "rank whose initial parameters every rank adopts")       \
  X(gradient_divide_factor, "", "", 0, "",                                                       \
    "what the summed gradients are divided by (FSDP2's name); 0 (Python: None): the "            \
    "data-parallel world size (the mean)")                                                       \
  X(sub_group_size, "sub_group_size", "", 1, "> 0 elements",                                     \
    "elements per optimizer sub-group (DeepSpeed's key): with offload the step runs sub-group "  \
    "by sub-group, and host staging buffers are one sub-group in size")                          \
  X(stage3_prefetch_bucket_size, "stage3_prefetch_bucket_size", "prefetch_bucket_size", 0,       \
    ">= 0 elements", "stage 3: elements the prefetch may gather ahead of the unit running now")  \
  X(stage3_param_persistence_threshold, "stage3_param_persistence_threshold",                    \
    "param_persistence_threshold", 0, ">= 0 elements",                                           \
    "stage 3: parameters with fewer elements stay gathered (biases, norms)")                     \
  X(stage3_max_live_parameters, "stage3_max_live_parameters", "max_live_parameters", 0,          \
    ">= 0 elements", "stage 3: gathered elements beyond which prefetching stops")                \
  X(check_collective_order, "", "", 0, "",                                                       \
    "stage 3: ranks agree on each gather and gradient reduction before issuing it, so they "     \
    "may run different modules (data-dependent routing, a branch on one rank, a module called "  \
    "twice here and once there), and compare every other collective, so a real divergence "      \
    "raises instead of hanging. Collectives of your own inside a forward whose modules differ "  \
    "between ranks (an expert-parallel all-to-all) need the block that issues them to be one "   \
    "unit (set_leaf_modules). False: every rank must run the same modules in the same order")

// What the list above says of one option.
struct ZeroOptionInfo {
  const char* name;
  const char* deepspeed_key;    // "" where a DeepSpeed config does not set it
  const char* deepspeed_alias;  // its older spelling, or ""
  double least;                 // the smallest value accepted
  const char* rule;             // the range as messages say it; "": not checked
  const char* doc;
};

// Calls visit(info, value) for each scalar option, `value` a reference to the
// option's field (const when `options` is).
template <typename Options, typename Visitor>
void for_each_scalar_zero_option(Options& options, Visitor&& visit) {
#define ZEROSHARD_VISIT_ZERO_OPTION(name, key, alias, least, rule, doc) \
  visit(ZeroOptionInfo{#name, key, alias, static_cast<double>(least), rule, doc}, options.name());
  ZEROSHARD_SCALAR_ZERO_OPTIONS(ZEROSHARD_VISIT_ZERO_OPTION)
#undef ZEROSHARD_VISIT_ZERO_OPTION
}

// Throws, naming the value and what is expected, if an option is invalid.
void validate_zero_options(const ZeroOptions& options, int64_t world_size);

}  // namespace zeroshard
