// zeroshard._C's memory estimator: per-rank bytes by stage, DeepSpeed's
// formulas, the recommendation and the activation estimate
// (memory_estimator.h), and the traffic estimate (traffic_estimator.h).
#include "zeroshard/memory_estimator.h"
#include "zeroshard/traffic_estimator.h"

#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

namespace py = pybind11;

namespace zeroshard {
namespace {

EstimateOptions estimate_options(
    double num_params, double largest_unit_params, int64_t world_size, int64_t ranks_per_node,
    const std::string& precision, const std::string& optimizer,
    const std::string& offload_optimizer, const std::string& offload_param,
    double offload_ratio = EstimateOptions().offload_ratio(),
    double sub_group_size = EstimateOptions().sub_group_size(),
    int64_t nvme_buffer_count = EstimateOptions().nvme_buffer_count(),
    double param_max_in_cpu = EstimateOptions().param_max_in_cpu(),
    int64_t param_buffer_count = EstimateOptions().param_buffer_count()) {
  return EstimateOptions()
      .nvme_buffer_count(nvme_buffer_count)
      .param_max_in_cpu(param_max_in_cpu)
      .param_buffer_count(param_buffer_count)
      .offload_ratio(offload_ratio)
      .sub_group_size(sub_group_size)
      .num_params(num_params)
      .largest_unit_params(largest_unit_params)
      .world_size(world_size)
      .ranks_per_node(ranks_per_node)
      .precision(parse_precision(precision))
      .optimizer(parse_state_kind(optimizer))
      .offload_optimizer(parse_offload_device(offload_optimizer))
      .offload_param(parse_offload_device(offload_param));
}

py::dict estimate_dict(const MemoryEstimate& e) {
  py::dict out;
  out["stage"] = e.stage;
  out["param_bytes"] = e.param_bytes;
  out["grad_bytes"] = e.grad_bytes;
  out["optimizer_bytes"] = e.optimizer_bytes;
  out["working_bytes"] = e.working_bytes;
  out["staging_bytes"] = e.staging_bytes;
  out["step_bytes"] = e.step_bytes;
  out["activation_bytes"] = e.activation_bytes;
  out["device_bytes"] = e.device_bytes;
  out["cpu_bytes_per_node"] = e.cpu_bytes_per_node;
  out["nvme_bytes_per_node"] = e.nvme_bytes_per_node;
  return out;
}

}  // namespace

void bind_estimator(py::module_& m) {
  // The defaults of the settings a caller may leave out: EstimateOptions',
  // which are ZeroOptions' and OffloadOptions' own.
  const EstimateOptions defaults;
  m.def(
      "estimate_memory",
      [](int64_t stage, double num_params, double largest_unit_params, int64_t world_size,
         int64_t ranks_per_node, const std::string& precision, const std::string& optimizer,
         const std::string& offload_optimizer, const std::string& offload_param,
         double offload_ratio, double sub_group_size, int64_t nvme_buffer_count,
         double param_max_in_cpu, int64_t param_buffer_count, int64_t tensor_parallel_size,
         int64_t pipeline_parallel_size, double activation_bytes, double reduce_bucket_size,
         int64_t max_buckets_in_flight, double prefetch_bucket_size, bool host_device,
         double max_live_parameters, bool reduce_in_fp32, bool swap_gradients,
         double optimizer_states) {
        return estimate_dict(zeroshard::estimate_memory(
            stage, estimate_options(num_params, largest_unit_params, world_size, ranks_per_node,
                                    precision, optimizer, offload_optimizer, offload_param,
                                    offload_ratio, sub_group_size, nvme_buffer_count,
                                    param_max_in_cpu, param_buffer_count)
                       .tensor_parallel_size(tensor_parallel_size)
                       .pipeline_parallel_size(pipeline_parallel_size)
                       .activation_bytes(activation_bytes)
                       .reduce_bucket_size(reduce_bucket_size)
                       .max_buckets_in_flight(max_buckets_in_flight)
                       .prefetch_bucket_size(prefetch_bucket_size)
                       .host_device(host_device)
                       .max_live_parameters(max_live_parameters)
                       .reduce_in_fp32(reduce_in_fp32)
                       .swap_gradients(swap_gradients)
                       .optimizer_states(optimizer_states)));
      },
      py::arg("stage"), py::arg("num_params"), py::arg("largest_unit_params"),
      py::arg("world_size"), py::arg("ranks_per_node"), py::arg("precision"), py::arg("optimizer"),
      py::arg("offload_optimizer"), py::arg("offload_param"),
      py::arg("offload_ratio") = defaults.offload_ratio(),
      py::arg("sub_group_size") = defaults.sub_group_size(),
      py::arg("nvme_buffer_count") = defaults.nvme_buffer_count(),
      py::arg("param_max_in_cpu") = defaults.param_max_in_cpu(),
      py::arg("param_buffer_count") = defaults.param_buffer_count(),
      py::arg("tensor_parallel_size") = defaults.tensor_parallel_size(),
      py::arg("pipeline_parallel_size") = defaults.pipeline_parallel_size(),
      py::arg("activation_bytes") = defaults.activation_bytes(),
      py::arg("reduce_bucket_size") = defaults.reduce_bucket_size(),
      py::arg("max_buckets_in_flight") = defaults.max_buckets_in_flight(),
      py::arg("prefetch_bucket_size") = defaults.prefetch_bucket_size(),
      py::arg("host_device") = defaults.host_device(),
      py::arg("max_live_parameters") = defaults.max_live_parameters(),
      py::arg("reduce_in_fp32") = defaults.reduce_in_fp32(),
      py::arg("swap_gradients") = defaults.swap_gradients(),
      py::arg("optimizer_states") = defaults.optimizer_states());
  m.def(
      "estimate_defaults",
      [defaults] {
        py::dict out;
        out["offload_ratio"] = defaults.offload_ratio();
        out["sub_group_size"] = defaults.sub_group_size();
        out["nvme_buffer_count"] = defaults.nvme_buffer_count();
        out["param_max_in_cpu"] = defaults.param_max_in_cpu();
        out["param_buffer_count"] = defaults.param_buffer_count();
        out["tensor_parallel_size"] = defaults.tensor_parallel_size();
        out["pipeline_parallel_size"] = defaults.pipeline_parallel_size();
        out["activation_bytes"] = defaults.activation_bytes();
        out["reduce_bucket_size"] = defaults.reduce_bucket_size();
        out["max_buckets_in_flight"] = defaults.max_buckets_in_flight();
        out["prefetch_bucket_size"] = defaults.prefetch_bucket_size();
        out["host_device"] = defaults.host_device();
        out["max_live_parameters"] = defaults.max_live_parameters();
        out["reduce_in_fp32"] = defaults.reduce_in_fp32();
        out["swap_gradients"] = defaults.swap_gradients();
        return out;
      },
      "estimate_memory's defaults (zeroshard::EstimateOptions', which are the options' own), "
      "by argument name, for python/zeroshard/estimator.py's signature.");
  m.def(
      "estimate_activation_bytes",
      [](int64_t layers, int64_t hidden, int64_t heads, int64_t vocab, int64_t sequence_length,
         int64_t micro_batch, int64_t bytes_per_value, bool checkpointing,
         int64_t tensor_parallel_size) {
        return zeroshard::estimate_activation_bytes(
            zeroshard::TransformerShape()
                .layers(layers)
                .hidden(hidden)
                .heads(heads)
                .vocab(vocab)
                .sequence_length(sequence_length)
                .micro_batch(micro_batch)
                .bytes_per_value(bytes_per_value)
                .checkpointing(checkpointing)
                .tensor_parallel_size(tensor_parallel_size));
      },
      py::arg("layers"), py::arg("hidden"), py::arg("heads"), py::arg("vocab"),
      py::arg("sequence_length"), py::arg("micro_batch"), py::arg("bytes_per_value") = 2,
      py::arg("checkpointing") = false, py::arg("tensor_parallel_size") = 1);
  m.def(
      "estimate_traffic",
      [](int64_t stage, double num_params, int64_t world_size, int64_t tensor_parallel_size,
         int64_t pipeline_parallel_size, const std::string& precision, int64_t layers,
         int64_t hidden, int64_t sequence_length, int64_t micro_batch, int64_t bytes_per_value,
         bool checkpointing, int64_t micro_batches) {
        const TrafficEstimate e =
            zeroshard::estimate_traffic(stage,
                                        EstimateOptions()
                                            .num_params(num_params)
                                            .world_size(world_size)
                                            .tensor_parallel_size(tensor_parallel_size)
                                            .pipeline_parallel_size(pipeline_parallel_size)
                                            .precision(parse_precision(precision)),
                                        TransformerShape()
                                            .layers(layers)
                                            .hidden(hidden)
                                            .sequence_length(sequence_length)
                                            .micro_batch(micro_batch)
                                            .bytes_per_value(bytes_per_value)
                                            .checkpointing(checkpointing),
                                        micro_batches);
        py::dict out;
        out["stage"] = e.stage;
        out["data_parallel_bytes"] = e.data_parallel_bytes;
        out["tensor_parallel_bytes"] = e.tensor_parallel_bytes;
        out["pipeline_parallel_bytes"] = e.pipeline_parallel_bytes;
        out["total_bytes"] = e.total_bytes();
        out["reduce_scatter_bytes"] = e.reduce_scatter_bytes;
        out["all_gather_bytes"] = e.all_gather_bytes;
        out["all_reduce_bytes"] = e.all_reduce_bytes;
        return out;
      },
      py::arg("stage"), py::arg("num_params"), py::arg("world_size"),
      py::arg("tensor_parallel_size"), py::arg("pipeline_parallel_size"), py::arg("precision"),
      py::arg("layers"), py::arg("hidden"), py::arg("sequence_length"), py::arg("micro_batch"),
      py::arg("bytes_per_value"), py::arg("checkpointing"), py::arg("micro_batches"));
  m.def(
      "deepspeed_estimate",
      [](int64_t stage, double num_params, double largest_unit_params, int64_t world_size,
         int64_t ranks_per_node, const std::string& offload_optimizer,
         const std::string& offload_param) {
        auto e = zeroshard::deepspeed_estimate(
            stage, estimate_options(num_params, largest_unit_params, world_size, ranks_per_node,
                                    "mixed16", "adam", offload_optimizer, offload_param));
        py::dict out;
        out["device_bytes"] = e.device_bytes;
        out["cpu_bytes"] = e.cpu_bytes;
        return out;
      },
      py::arg("stage"), py::arg("num_params"), py::arg("largest_unit_params"),
      py::arg("world_size"), py::arg("ranks_per_node"), py::arg("offload_optimizer"),
      py::arg("offload_param"));
  m.def(
      "recommend_configuration",
      [](double num_params, double largest_unit_params, int64_t world_size, int64_t ranks_per_node,
         const std::string& precision, const std::string& optimizer, double device_bytes,
         int64_t tensor_parallel_size, int64_t pipeline_parallel_size) {
        auto r = zeroshard::recommend_configuration(
            estimate_options(num_params, largest_unit_params, world_size, ranks_per_node, precision,
                             optimizer, "none", "none")
                .tensor_parallel_size(tensor_parallel_size)
                .pipeline_parallel_size(pipeline_parallel_size),
            device_bytes);
        py::dict out;
        out["fits"] = r.fits;
        out["estimate"] = estimate_dict(r.estimate);
        out["offload_optimizer"] = zeroshard::offload_device_name(r.offload_optimizer);
        out["offload_param"] = zeroshard::offload_device_name(r.offload_param);
        out["reason"] = r.reason;
        return out;
      },
      py::arg("num_params"), py::arg("largest_unit_params"), py::arg("world_size"),
      py::arg("ranks_per_node"), py::arg("precision"), py::arg("optimizer"),
      py::arg("device_bytes"), py::arg("tensor_parallel_size") = 1,
      py::arg("pipeline_parallel_size") = 1);
}

}  // namespace zeroshard
