// Bytes a rank sends per optimizer step over each of its groups: ZeRO's
// data-parallel collectives (the ZeRO paper's 2Ψ for stages 0-2, 3Ψ for
// stage 3), Megatron-style tensor parallelism's activation all-reduces and
// pipeline parallelism's activation sends. The estimate's inputs are the
// memory estimator's (Ψ, world = DP x TP x PP, precision) plus, for TP and
// PP, the transformer's shape.
#pragma once

#include "zeroshard/memory_estimator.h"

#include <cstdint>

namespace zeroshard {

struct TrafficEstimate {
  int64_t stage = 0;
  // Sent by one rank per step, with ring collectives: a reduce-scatter or an
  // all-gather of n bytes over g ranks sends n(g-1)/g, an all-reduce twice
  // that.
  double data_parallel_bytes = 0;
  double tensor_parallel_bytes = 0;
  double pipeline_parallel_bytes = 0;
  // The data-parallel collectives' full sizes, as zeroshard's comm_stats()
  // counts them (a reduce-scatter's input, an all-gather's output, an
  // all-reduce's buffer). Padding and the step's small agreements are not
  // counted.
  double reduce_scatter_bytes = 0;
  double all_gather_bytes = 0;
  double all_reduce_bytes = 0;
  double total_bytes() const {
    return data_parallel_bytes + tensor_parallel_bytes + pipeline_parallel_bytes;
  }
};

// options: num_params (Ψ, the whole model), world_size (DP x TP x PP),
// tensor_parallel_size, pipeline_parallel_size, precision (16-bit or fp32
// communication). Gradients are reduced once per step (accumulation under
// no_sync, as zeroshard's pipeline stage does); at stage 3 parameters are
// gathered in every micro-batch's forward and backward (zeroshard without a
// prefetch window; the window keeps units the backward reuses gathered, so
// it moves less, down to stage 2's volume for a model that fits in it). TP and PP traffic
// need shape.layers, hidden, sequence_length and micro_batch (zero
// otherwise): per layer and micro-batch, two activation all-reduces forward
// and two backward (attention and MLP outputs; two more forward with
// shape.checkpointing), and a pipeline stage sends each micro-batch's
// activations forward and their gradients back (a stage in the middle both
// ways). micro_batches: per step and rank (accumulation steps x pipeline
// micro-batches).
TrafficEstimate estimate_traffic(int64_t stage, const EstimateOptions& options,
                                 const TransformerShape& shape = {}, int64_t micro_batches = 1);

}  // namespace zeroshard
