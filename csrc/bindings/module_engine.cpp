// The DeepSpeed config and the Engine for Python (python/zeroshard/engine.py).
#include "zeroshard/engine.h"
#include "zeroshard/text.h"

#include <torch/csrc/utils/pybind.h>

// After torch's pybind11 setup above.
#include "checkpoint_bindings.h"
#include "options_from_python.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace zeroshard {
namespace {

// The keyword arguments python/zeroshard/optimizer.py's ZeroOptimizer takes
// for this config: the inner optimizer, its hyper-parameters, ZeRO options.
py::dict optimizer_arguments(const DeepSpeedConfig& config) {
  const ZeroOptions options = zero_options_from_config(config);
  py::dict zero;
  zero["stage"] = options.stage();
  zero["reduce_bucket_size"] = options.reduce_bucket_size();
  zero["overlap_comm"] = options.overlap_comm();
  zero["max_norm"] = options.max_norm();
  zero["stage3_prefetch_bucket_size"] = options.stage3_prefetch_bucket_size();
  zero["stage3_param_persistence_threshold"] = options.stage3_param_persistence_threshold();
  zero["stage3_max_live_parameters"] = options.stage3_max_live_parameters();
  zero["skip_nonfinite_steps"] = options.skip_nonfinite_steps();
  zero["reduce_in_fp32"] = options.reduce_in_fp32();
  zero["sub_group_size"] = options.sub_group_size();
  zero["aio"] = aio_dict(options.aio());
  zero["offload_optimizer"] =
      offload_section_dict(options.offload_optimizer(), kOffloadOptimizerSection);
  zero["offload_param"] = offload_section_dict(options.offload_param(), kOffloadParamSection);
  py::dict hyper;
  const auto& p = config.optimizer_params;
  const std::string kind = lowercase(config.optimizer_type);
  TORCH_CHECK_VALUE(!kind.empty(),
                    "the config has no \"optimizer\" section; zeroshard.initialize builds the "
                    "optimizer from it (\"optimizer\": {\"type\": \"AdamW\", \"params\": "
                    "{\"lr\": ...}})");
  if (kind == "muon") {  // [Note: DeepSpeed's Muon]: zeroshard.deepspeed_muon splits the groups
    const py::object loads = py::module_::import("json").attr("loads");
    hyper["muon"] = loads(p.at("muon").dump());
    hyper["adam"] = loads(p.at("adam").dump());
    hyper["adam_w_mode"] = p.at("adam_w_mode").get<bool>();
  } else {
    hyper["lr"] = p.at("lr").get<double>();
    hyper["weight_decay"] = p.at("weight_decay").get<double>();
  }
  if (kind == "sgd") {
    hyper["momentum"] = p.at("momentum").get<double>();
    hyper["dampening"] = p.at("dampening").get<double>();
    hyper["nesterov"] = p.at("nesterov").get<bool>();
  } else if (kind != "muon") {
    hyper["betas"] = py::make_tuple(p.at("betas")[0].get<double>(), p.at("betas")[1].get<double>());
    hyper["eps"] = p.at("eps").get<double>();
    hyper["amsgrad"] = p.at("amsgrad").get<bool>();
  }
  py::dict out;
  out["optimizer"] = kind;
  out["hyperparameters"] = hyper;
  out["zero_options"] = zero;
  return out;
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<DeepSpeedConfig>(m, "DeepSpeedConfig")
      .def_readonly("train_batch_size", &DeepSpeedConfig::train_batch_size)
      .def_readonly("train_micro_batch_size_per_gpu",
                    &DeepSpeedConfig::train_micro_batch_size_per_gpu)
      .def_readonly("gradient_accumulation_steps", &DeepSpeedConfig::gradient_accumulation_steps)
      .def_readonly("zero_stage", &DeepSpeedConfig::zero_stage)
      .def_readonly("shard_group_size", &DeepSpeedConfig::shard_group_size)
      .def_readonly("gradient_clipping", &DeepSpeedConfig::gradient_clipping)
      .def_readonly("steps_per_print", &DeepSpeedConfig::steps_per_print)
      .def_readonly("unsupported", &DeepSpeedConfig::unsupported)
      .def_readonly("unit_classes", &DeepSpeedConfig::unit_classes)
      .def_property_readonly("fp16", [](const DeepSpeedConfig& c) { return c.fp16.enabled; })
      .def_property_readonly("bf16", [](const DeepSpeedConfig& c) { return c.bf16.enabled; })
      .def_property_readonly(
          "has_scheduler",
          [](const DeepSpeedConfig& c) { return c.scheduler.type != LrScheduleType::kNone; })
      .def("optimizer_arguments", &optimizer_arguments)
      .def("check_supported", [](const DeepSpeedConfig& c) { check_supported(c); })
      .def("has_auto_settings", [](const DeepSpeedConfig& c) { return has_auto_settings(c); })
      .def_property_readonly("nvme_paths",
                             [](const DeepSpeedConfig& c) {
                               return py::make_tuple(c.zero.offload_optimizer().nvme_path(),
                                                     c.zero.offload_param().nvme_path());
                             })
      .def(
          "resolve_auto",
          [](DeepSpeedConfig& c, double num_params, double largest_unit_params,
             int64_t ranks_per_node, double device_bytes, double host_bytes, double nvme_bytes,
             bool device_is_host, bool needs_stage3, double activation_bytes) {
            AvailableMemory available;
            available.device_bytes = device_bytes;
            available.host_bytes = host_bytes;
            available.nvme_bytes = nvme_bytes;
            available.device_is_host = device_is_host;
            return resolve_auto_configuration(c, num_params, largest_unit_params, ranks_per_node,
                                              available, needs_stage3, activation_bytes);
          },
          py::arg("num_params"), py::arg("largest_unit_params"), py::arg("ranks_per_node"),
          py::arg("device_bytes"), py::arg("host_bytes"), py::arg("nvme_bytes"),
          py::arg("device_is_host"), py::arg("needs_stage3") = false,
          py::arg("activation_bytes") = 0.0,
          "Resolves \"auto\" settings (see zeroshard::resolve_auto_configuration); returns "
          "the decision and its figures, raises ValueError naming what is short.");
  m.def(
      "parse_deepspeed_config",
      [](const std::string& text, int64_t world_size) {
        nlohmann::json json;
        try {
          json = nlohmann::json::parse(text);
        } catch (const nlohmann::json::parse_error& e) {
          TORCH_CHECK_VALUE(false, "the DeepSpeed config is not valid JSON: ", e.what());
        }
        return parse_deepspeed_config(json, world_size);
      },
      py::arg("text"), py::arg("world_size"));
  m.def("load_deepspeed_config", &load_deepspeed_config, py::arg("path"), py::arg("world_size"));
  m.def("uses_deepspeed_muon", &uses_deepspeed_muon, py::arg("name"), py::arg("dim"),
        "Whether DeepSpeed's Muon gives an unmarked parameter of this name and number of "
        "dimensions to its Muon half.");
  m.def("scheduled_lr", &scheduled_lr, py::arg("config"), py::arg("step"), py::arg("base_lr"),
        "The learning rate DeepSpeed's scheduler sets at last_batch_iteration `step`.");

  py::class_<Engine> engine_class(m, "Engine");
  bind_engine_checkpoint(engine_class);
  engine_class
      .def(py::init<ZeroOptimizer&, DeepSpeedConfig>(), py::arg("optimizer"), py::arg("config"),
           py::keep_alive<1, 2>())
      .def("begin_forward", &Engine::begin_forward)
      .def("end_forward", &Engine::end_forward)
      .def("backward", &Engine::backward, py::arg("loss"), py::call_guard<py::gil_scoped_release>())
      .def("step", &Engine::step, py::call_guard<py::gil_scoped_release>())
      .def("is_gradient_accumulation_boundary", &Engine::is_gradient_accumulation_boundary)
      .def_property_readonly("global_steps", &Engine::global_steps)
      .def_property_readonly("micro_steps", &Engine::micro_steps)
      .def_property_readonly("skipped_steps", &Engine::skipped_steps)
      .def("train_batch_size", &Engine::train_batch_size)
      .def("train_micro_batch_size_per_gpu", &Engine::train_micro_batch_size_per_gpu)
      .def("gradient_accumulation_steps", &Engine::gradient_accumulation_steps)
      .def("get_lr", &Engine::get_lr)
      .def_property_readonly("loss_scale", &Engine::loss_scale)
      .def("last_telemetry",
           [](const Engine& self) -> py::object {
             const auto& record = self.last_telemetry();
             if (!record) {
               return py::object(py::none());
             }
             // TelemetryRecord::to_json is the one list of fields.
             py::dict out = py::module_::import("json").attr("loads")(record->to_json());
             out["line"] = record->to_line();
             return py::object(out);
           })
      .def(
          "set_device_peak_source",
          [](Engine& self, py::function source) {
            // Called from step() with the GIL released.
            auto shared = std::make_shared<py::function>(std::move(source));
            self.set_device_peak_source([shared]() {
              py::gil_scoped_acquire gil;
              return (*shared)().cast<int64_t>();
            });
          },
          py::arg("source"));
}

}  // namespace zeroshard
