#include "zeroshard/traffic_estimator.h"

#include <c10/util/Exception.h>

namespace zeroshard {

TrafficEstimate estimate_traffic(int64_t stage, const EstimateOptions& options,
                                 const TransformerShape& shape, int64_t micro_batches) {
  TORCH_CHECK_VALUE(stage >= 0 && stage <= 3, "estimate_traffic: stage must be 0-3, got ", stage);
  const int64_t tp = options.tensor_parallel_size(), pp = options.pipeline_parallel_size();
  TORCH_CHECK_VALUE(tp >= 1 && pp >= 1 && options.world_size() % (tp * pp) == 0,
                    "estimate_traffic: world_size ", options.world_size(),
                    " must be a multiple of tensor_parallel_size x pipeline_parallel_size (", tp,
                    " x ", pp, ")");
  TORCH_CHECK_VALUE(micro_batches >= 1, "estimate_traffic: micro_batches must be >= 1, got ",
                    micro_batches);
  TrafficEstimate out;
  out.stage = stage;
  const double dp = static_cast<double>(options.world_size() / (tp * pp));
  const double value_bytes = options.precision() == PrecisionRecipe::kFp32 ? 4.0 : 2.0;
  // The model slice one rank holds, in communication bytes.
  const double slice = options.num_params() / static_cast<double>(tp * pp) * value_bytes;
  const double ring = (dp - 1) / dp;
  if (stage == 0) {
    out.all_reduce_bytes = slice;
    out.data_parallel_bytes = 2 * ring * slice;
  } else {
    const double gathers = stage == 3 ? 2.0 * static_cast<double>(micro_batches) : 1.0;
    out.reduce_scatter_bytes = slice;
    out.all_gather_bytes = gathers * slice;
    out.data_parallel_bytes = (1 + gathers) * ring * slice;
  }
  // One micro-batch's activations at a layer boundary.
  const double activation =
      static_cast<double>(shape.micro_batch()) * static_cast<double>(shape.sequence_length()) *
      static_cast<double>(shape.hidden()) * static_cast<double>(shape.bytes_per_value());
  const double layers_here = static_cast<double>(shape.layers()) / static_cast<double>(pp);
  if (tp > 1) {
    const double all_reduces = shape.checkpointing() ? 6.0 : 4.0;
    const double t = static_cast<double>(tp);
    out.tensor_parallel_bytes = static_cast<double>(micro_batches) * layers_here * all_reduces * 2 *
                                (t - 1) / t * activation;
  }
  if (pp > 1) {
    const double directions = pp > 2 ? 2.0 : 1.0;
    out.pipeline_parallel_bytes = static_cast<double>(micro_batches) * directions * activation;
  }
  return out;
}

}  // namespace zeroshard
