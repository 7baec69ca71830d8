// The only C++ that knows Python: exposes the core to python/zeroshard.
#include "zeroshard/communicator.h"
#include "zeroshard/memory_estimator.h"
#include "zeroshard/nvme_gradient_swapper.h"
#include "zeroshard/nvme_parameter_swapper.h"
#include "zeroshard/nvme_state_swapper.h"
#include "zeroshard/optimizer_states.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/update_rule.h"
#include "zeroshard/zero_optimizer.h"

#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <optional>
#include <tuple>
#include <type_traits>

// After torch's pybind11 setup above.
#include "checkpoint_bindings.h"
#include "no_gil_delete.h"
#include "options_from_python.h"

namespace py = pybind11;

namespace zeroshard {
// Defined in module_hooks.cpp and module_engine.cpp.
void bind_module_hooks(py::module_& m);
void bind_engine(py::module_& m);
void bind_host_kernel(py::module_& m);
void bind_update_rules(py::module_& m);
void bind_estimator(py::module_& m);  // module_estimator.cpp
}  // namespace zeroshard

// [Note: GIL and collectives]
// Every binding that issues a collective releases the GIL first. Gloo's
// worker thread may drop the last reference to a tensor whose storage has a
// Python object (torch.save creates one for the model's flat buffers) while
// holding its queue lock; freeing it takes the GIL. A caller that enqueued the
// next collective while holding the GIL would wait for that lock forever.

namespace zeroshard {
namespace {

// The keys every NVMe swap space reports (nvme_stats()).
template <typename Swapper>
py::dict swap_io_stats(const Swapper& swapper) {
  py::dict out;
  out["directory"] = swapper.directory();
  out["disk_bytes"] = swapper.disk_bytes();
  out["bytes_read"] = swapper.bytes_read();
  out["bytes_written"] = swapper.bytes_written();
  out["io_wait_seconds"] = swapper.io_wait_seconds();
  return out;
}

NoGilHolder<ZeroOptimizer> make_zero_optimizer(
    const std::vector<std::vector<at::Tensor>>& groups,
    const c10::intrusive_ptr<c10d::ProcessGroup>& process_group, const py::object& optimizer,
    const std::vector<py::dict>& group_hyperparameters, const py::dict& zero_options,
    const std::vector<std::pair<std::string, std::vector<at::Tensor>>>& units,
    const c10::intrusive_ptr<c10d::ProcessGroup>& replicate_group) {
  TORCH_CHECK_VALUE(groups.size() == group_hyperparameters.size(),
                    "one hyper-parameter dict per parameter group expected");
  // `optimizer`: a built-in rule's name, or one UpdateRule per group.
  const bool rules = !py::isinstance<py::str>(optimizer);
  std::vector<std::shared_ptr<UpdateRule>> group_rules;
  if (rules) {
    group_rules = optimizer.cast<std::vector<std::shared_ptr<UpdateRule>>>();
    TORCH_CHECK_VALUE(group_rules.size() == groups.size() && !groups.empty(),
                      "one update rule per parameter group expected");
  }
  auto options_of = [&](size_t g) -> std::unique_ptr<torch::optim::OptimizerOptions> {
    if (rules) {
      return std::make_unique<RuleOptions>(group_rules[g],
                                           json_from_python(group_hyperparameters[g]));
    }
    return make_options(parse_inner_optimizer(optimizer.cast<std::string>()),
                        g < group_hyperparameters.size() ? group_hyperparameters[g] : py::dict());
  };
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    param_groups.emplace_back(groups[g], options_of(g));
  }
  auto defaults = options_of(0);
  const ZeroOptions options = zero_options_from(zero_options);
  std::vector<ParameterUnit> parameter_units;
  for (const auto& [name, params] : units) {
    parameter_units.push_back(ParameterUnit{name, params});
  }
  // See [Note: GIL and collectives].
  py::gil_scoped_release release;
  return NoGilHolder<ZeroOptimizer>(new ZeroOptimizer(param_groups, process_group, replicate_group,
                                                      *defaults, options,
                                                      std::move(parameter_units)));
}

py::dict comm_stats_dict(const CommStats& stats, int64_t world_size) {
  py::dict out;
  out["wire_bytes"] = stats.wire_bytes(world_size);
  out["all_reduce_bytes"] = stats.all_reduce_bytes;
  out["reduce_scatter_bytes"] = stats.reduce_scatter_bytes;
  out["all_gather_bytes"] = stats.all_gather_bytes;
  out["broadcast_bytes"] = stats.broadcast_bytes;
  out["total_bytes"] = stats.total_bytes();
  out["calls"] = stats.calls;
  out["wait_seconds"] = stats.wait_seconds;
  return out;
}

}  // namespace
}  // namespace zeroshard

PYBIND11_MODULE(_C, m) {
  using zeroshard::ZeroOptimizer;
  m.doc() = "zeroshard C++ core (ZeRO optimizer sharding over c10d)";

  // c10 errors become the matching Python exceptions, without the C++
  // backtrace, so users read the message they can act on.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::DistBackendError& e) {
      // A failed collective is torch.distributed.DistBackendError wherever
      // it surfaces: a stage 3 forward hook as much as step().
      // torch_python's own pointer to it is not exported to extensions.
      static PyObject* dist_backend_error =
          py::object(py::module_::import("torch.distributed").attr("DistBackendError"))
              .release()
              .ptr();
      PyErr_SetString(dist_backend_error, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  m.def(
      "io_uring_available", [] { return zeroshard::io_uring_available(); },
      "Whether the NVMe tier's I/O can use io_uring here (built in and permitted).");
  zeroshard::bind_estimator(m);
  m.def("zero_option_defaults", &zeroshard::zero_option_defaults,
        "The defaults of ZeroOptions' scalar options, by name.");
  m.def("inner_optimizer_defaults", &zeroshard::inner_optimizer_default_dicts,
        "Each inner optimizer's hyper-parameters with torch.optim's defaults, by optimizer.");
  m.def("offload_option_keys", &zeroshard::offload_option_keys,
        "The keys of the offload_optimizer, offload_param and aio sections with their "
        "defaults, by section.");
  m.def("offload_ignored_keys", &zeroshard::offload_ignored_keys,
        "DeepSpeed's keys each section accepts and does not use, by section.");
  m.def("zero_option_docs", &zeroshard::zero_option_docs,
        "One-line descriptions of ZeroOptions' scalar options, by name.");
  m.def(
      "optimizer_state_names",
      [] {
        std::vector<std::string> names;
        for (zeroshard::OptimizerStateName state : zeroshard::all_optimizer_states()) {
          names.emplace_back(zeroshard::optimizer_state_name(state));
        }
        return names;
      },
      "The names of the states a shard may hold (optimizer_states.h), the master first.");

  m.def(
      "inner_update",
      [](const std::string& optimizer, const py::dict& hyperparameters, at::Tensor param,
         at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, at::Tensor momentum_buffer,
         int64_t step, bool fused) {
        const auto kind = zeroshard::parse_inner_optimizer(optimizer);
        auto options = zeroshard::make_options(kind, hyperparameters);
        zeroshard::validate_inner_options(kind, *options);
        zeroshard::ShardView view{param, grad, exp_avg, exp_avg_sq, at::Tensor(), momentum_buffer};
        py::gil_scoped_release release;
        zeroshard::apply_inner_update(kind, *options, view, step, fused);
      },
      py::arg("optimizer"), py::arg("hyperparameters"), py::arg("param"), py::arg("grad"),
      py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("momentum_buffer"), py::arg("step"),
      py::arg("fused") = false,
      "One inner-optimizer update of flat fp32 tensors in place (for benchmarks and tests).");

  py::class_<ZeroOptimizer, zeroshard::NoGilHolder<ZeroOptimizer>> optimizer_class(m,
                                                                                   "ZeroOptimizer");
  zeroshard::bind_module_hooks(m);
  zeroshard::bind_engine(m);
  zeroshard::bind_host_kernel(m);
  zeroshard::bind_update_rules(m);
  zeroshard::bind_checkpoint_io(m);
  zeroshard::bind_optimizer_checkpoint(optimizer_class);
  optimizer_class
      .def(py::init(&zeroshard::make_zero_optimizer), py::arg("param_groups"),
           py::arg("process_group"), py::arg("optimizer"), py::arg("group_hyperparameters"),
           py::arg("zero_options"), py::arg("units"), py::arg("replicate_group") = py::none())
      .def(
          "set_hyperparameters",
          [](ZeroOptimizer& self, const std::vector<py::dict>& values) {
            auto& groups = self.param_groups();
            TORCH_CHECK_VALUE(values.size() == groups.size(), "expected ", groups.size(),
                              " hyper-parameter dicts, got ", values.size());
            for (size_t g = 0; g < groups.size(); ++g) {
              zeroshard::apply_hyperparameters(self.inner_kind(), groups[g].options(), values[g]);
            }
          },
          py::arg("group_hyperparameters"))
      .def(
          "step", [](ZeroOptimizer& self) { self.step(); },
          py::call_guard<py::gil_scoped_release>())
      .def("shard_state",
           [](const ZeroOptimizer& self) {
             py::dict out;
             for (const auto& [key, tensor] : self.shard_state()) {
               out[py::str(key)] = tensor;
             }
             return out;
           })
      .def(
          "parameter_state",
          [](const ZeroOptimizer& self, size_t group, int64_t index, bool read_states) {
            const auto part = self.parameter_state(group, index, read_states);
            py::dict states;
            for (const auto& [name, tensor] : part.states) {
              states[py::str(name)] = tensor;
            }
            return py::make_tuple(part.param_offset, part.numel, part.steps, states);
          },
          py::arg("group"), py::arg("index"), py::arg("read_states") = true)
      .def("write_parameter_state", &ZeroOptimizer::write_parameter_state, py::arg("group"),
           py::arg("index"), py::arg("name"), py::arg("values"))
      .def(
          "load_shard_state",
          [](ZeroOptimizer& self, const std::map<std::string, at::Tensor>& state) {
            zeroshard::ShardState entries(state.begin(), state.end());
            py::gil_scoped_release release;
            self.load_shard_state(entries);
          },
          py::arg("state"))
      .def(
          "zero_grad", [](ZeroOptimizer& self, bool set_to_none) { self.zero_grad(set_to_none); },
          py::arg("set_to_none") = true, py::call_guard<py::gil_scoped_release>())
      .def("clip_grad_norm", &ZeroOptimizer::clip_grad_norm, py::arg("max_norm"),
           py::call_guard<py::gil_scoped_release>())
      .def("gradient_norm", &ZeroOptimizer::gradient_norm, py::call_guard<py::gil_scoped_release>())
      .def("scale_gradients", &ZeroOptimizer::scale_gradients, py::arg("coefficient"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "set_failure_store",
          [](ZeroOptimizer& self, const c10::intrusive_ptr<c10d::Store>& store,
             const std::string& prefix, double report_seconds) {
            self.communicator().set_failure_store(
                store, prefix,
                std::chrono::milliseconds(static_cast<int64_t>(report_seconds * 1000)));
          },
          py::arg("store"), py::arg("prefix"), py::arg("report_seconds"),
          "Where ranks report a failed collective, so errors name the lost ranks.")
      .def("set_checkpoint_store", &ZeroOptimizer::set_checkpoint_store, py::arg("store"),
           py::arg("prefix"),
           "Where the ranks of an asynchronous save agree on its commit: a store they all reach.")
      .def(
          "set_replica_failure_store",
          [](ZeroOptimizer& self, const c10::intrusive_ptr<c10d::Store>& store,
             const std::string& prefix, double report_seconds) {
            if (zeroshard::Communicator* replicas = self.replica_communicator()) {
              replicas->set_failure_store(
                  store, prefix,
                  std::chrono::milliseconds(static_cast<int64_t>(report_seconds * 1000)));
            }
          },
          py::arg("store"), py::arg("prefix"), py::arg("report_seconds"),
          "set_failure_store for the replicate group (hybrid sharding).")
      .def(
          "set_tensor_parallel",
          [](ZeroOptimizer& self, c10::intrusive_ptr<c10d::ProcessGroup> group,
             std::vector<std::vector<bool>> sharded,
             const std::vector<std::vector<std::tuple<int64_t, int64_t, std::vector<int64_t>>>>&
                 splits) {
            std::vector<std::vector<zeroshard::TensorParallelSplit>> converted(splits.size());
            for (size_t g = 0; g < splits.size(); ++g) {
              for (const auto& [dim, start, full_shape] : splits[g]) {
                converted[g].push_back({dim, start, full_shape});
              }
            }
            py::gil_scoped_release released;
            self.set_tensor_parallel(std::move(group), std::move(sharded), std::move(converted));
          },
          py::arg("group"), py::arg("sharded"), py::arg("splits"),
          "splits: per group, per parameter (dim, start, unsplit shape); dim -1 for a copy.")
      .def("set_expert_parallel", &ZeroOptimizer::set_expert_parallel, py::arg("group"),
           py::call_guard<py::gil_scoped_release>())
      .def("model_parallel",
           [](const ZeroOptimizer& self) {
             switch (self.model_parallel()) {
               case ZeroOptimizer::ModelParallel::kTensor:
                 return "tensor";
               case ZeroOptimizer::ModelParallel::kExpert:
                 return "expert";
               case ZeroOptimizer::ModelParallel::kNone:
                 break;
             }
             return "none";
           })
      .def("checkpoint_rank", &ZeroOptimizer::checkpoint_rank)
      .def("skip_next_step", &ZeroOptimizer::skip_next_step)
      .def("check_next_step_for_overflow", &ZeroOptimizer::check_next_step_for_overflow)
      .def("gradient_arrived", &ZeroOptimizer::gradient_arrived, py::arg("group"), py::arg("index"),
           py::call_guard<py::gil_scoped_release>())
      .def("retired_work_count",
           [](ZeroOptimizer& self) { return self.communicator().release_finished_work(); })
      .def("set_gradient_sync", &ZeroOptimizer::set_gradient_sync, py::arg("enabled"))
      .def("gradient_sync", &ZeroOptimizer::gradient_sync)
      .def("gradient_bytes", &ZeroOptimizer::gradient_bytes)
      .def("host_gradient_bytes", &ZeroOptimizer::host_gradient_bytes)
      .def("peak_staging_bytes", &ZeroOptimizer::peak_staging_bytes)
      .def("reset_peak_staging_bytes", &ZeroOptimizer::reset_peak_staging_bytes)
      .def("cached_buffer_bytes", &ZeroOptimizer::cached_buffer_bytes)
      .def("release_cached_buffers", &ZeroOptimizer::release_cached_buffers)
      .def("optimizer_state_bytes", &ZeroOptimizer::optimizer_state_bytes)
      .def("device_model_state_bytes", &ZeroOptimizer::device_model_state_bytes)
      .def("host_model_state_bytes", &ZeroOptimizer::host_model_state_bytes)
      .def("nvme_stats",
           [](const ZeroOptimizer& self) -> py::object {
             const zeroshard::NvmeStateSwapper* swapper = self.nvme_swapper();
             const zeroshard::NvmeParameterSwapper* params = self.parameter_swapper();
             const zeroshard::NvmeGradientSwapper* grads = self.gradient_swapper();
             if (swapper == nullptr && params == nullptr) {
               return py::none();
             }
             py::dict out;
             if (swapper != nullptr) {
               out = zeroshard::swap_io_stats(*swapper);
               out["backend"] = swapper->io_backend();
               out["buffer_bytes"] = swapper->buffer_bytes();
             }
             if (params != nullptr) {
               py::dict p = zeroshard::swap_io_stats(*params);
               p["backend"] = params->io_backend();
               p["host_shard_bytes"] = params->host_shard_bytes();
               p["ahead_bytes"] = params->ahead_bytes();
               p["peak_ahead_bytes"] = params->peak_ahead_bytes();
               p["reads_ahead"] = params->reads_ahead();
               p["reads_on_demand"] = params->reads_on_demand();
               out["parameters"] = p;
             }
             if (grads != nullptr) {
               py::dict g = zeroshard::swap_io_stats(*grads);
               g["buffer_bytes"] = grads->buffer_bytes();
               g["peak_buffer_bytes"] = grads->peak_buffer_bytes();
               out["gradients"] = g;
             }
             return out;
           })
      .def("flat_parameters", &ZeroOptimizer::flat_parameters, py::arg("group"))
      .def("comm_stats",
           [](ZeroOptimizer& self) {
             return zeroshard::comm_stats_dict(self.communicator().stats(),
                                               self.communicator().world_size());
           })
      .def("replica_comm_stats",
           [](ZeroOptimizer& self) {
             zeroshard::Communicator* replicas = self.replica_communicator();
             return zeroshard::comm_stats_dict(
                 replicas ? replicas->stats() : zeroshard::CommStats{},
                 replicas ? replicas->world_size() : 1);
           })
      .def("reset_comm_stats",
           [](ZeroOptimizer& self) {
             self.communicator().reset_stats();
             if (zeroshard::Communicator* replicas = self.replica_communicator()) {
               replicas->reset_stats();
             }
           })
      // Errors name each rank's call: see
      // [Note: Which call a rank is in] in communicator.h.
      .def(
          "enter_call",
          [](ZeroOptimizer& self, const std::string& call) {
            self.communicator().enter_call(call);
          },
          py::arg("call"),
          "Names the public call this rank is in; calls nest, the outermost names it.")
      .def("exit_call", [](ZeroOptimizer& self) { self.communicator().exit_call(); })
      .def("set_event_log_enabled",
           [](ZeroOptimizer& self, bool enabled) {
             self.communicator().set_event_log_enabled(enabled);
           })
      .def("event_log",
           [](ZeroOptimizer& self) {
             py::list out;
             for (const auto& e : self.communicator().event_log()) {
               out.append(
                   py::make_tuple(e.what, zeroshard::collective_kind_name(e.kind), e.bytes, e.tag));
             }
             return out;
           })
      .def("full_parameters", &ZeroOptimizer::full_parameters, py::arg("rank") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("num_units", &ZeroOptimizer::num_units)
      .def("agreements", &ZeroOptimizer::agreements)
      .def("diverged_agreements", &ZeroOptimizer::diverged_agreements)
      .def("host_sync_counts", &ZeroOptimizer::host_sync_counts)
      .def(
          "set_host_channel",
          [](ZeroOptimizer& self, std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> group) {
            self.set_host_channel(group ? *group : c10::intrusive_ptr<c10d::ProcessGroup>());
          },
          py::arg("group"))
      .def("last_step_skipped", &ZeroOptimizer::last_step_skipped)
      .def("skipped_steps", &ZeroOptimizer::skipped_steps)
      .def("set_loss_scale", &ZeroOptimizer::set_loss_scale, py::arg("scale"))
      .def("pin_parameters", &ZeroOptimizer::pin_parameters, py::arg("params"),
           py::call_guard<py::gil_scoped_release>())
      .def("unpin_parameters", &ZeroOptimizer::unpin_parameters, py::arg("params"),
           py::arg("modifier_rank") = -1, py::call_guard<py::gil_scoped_release>())
      .def("broadcast_buffers", &ZeroOptimizer::broadcast_buffers, py::arg("buffers"),
           py::call_guard<py::gil_scoped_release>())
      .def("replacement_parameters", &ZeroOptimizer::replacement_parameters)
      .def("adopt_parameters", &ZeroOptimizer::adopt_parameters, py::arg("params"))
      .def("begin_initialization", &ZeroOptimizer::begin_initialization, py::arg("params"),
           py::call_guard<py::gil_scoped_release>())
      .def("end_initialization", &ZeroOptimizer::end_initialization, py::arg("params"),
           py::call_guard<py::gil_scoped_release>())
      .def("finish_initialization", &ZeroOptimizer::finish_initialization, py::arg("local_error"),
           py::call_guard<py::gil_scoped_release>())
      .def("parameter_bytes", &ZeroOptimizer::parameter_bytes)
      .def("gathered_parameter_bytes", &ZeroOptimizer::gathered_parameter_bytes)
      .def("peak_gathered_parameter_bytes", &ZeroOptimizer::peak_gathered_parameter_bytes)
      .def("reset_peak_gathered_parameter_bytes",
           &ZeroOptimizer::reset_peak_gathered_parameter_bytes)
      .def_property_readonly("rank", [](ZeroOptimizer& self) { return self.communicator().rank(); })
      .def_property_readonly("world_size",
                             [](ZeroOptimizer& self) { return self.communicator().world_size(); })
      .def_property_readonly("data_parallel_world_size", &ZeroOptimizer::data_parallel_world_size)
      .def_property_readonly("layout_fingerprint",
                             [](const ZeroOptimizer& self) { return self.layout().fingerprint(); })
      .def(
          "shard_numel",
          [](const ZeroOptimizer& self, size_t group) {
            return self.layout().group(group).shard_numel();
          },
          py::arg("group"))
      .def(
          "flat_numel",
          [](const ZeroOptimizer& self, size_t group) {
            return self.layout().group(group).flat_numel();
          },
          py::arg("group"))
      .def(
          "num_buckets",
          [](const ZeroOptimizer& self, size_t group) {
            return self.layout().group(group).buckets().size();
          },
          py::arg("group"))
      .def(
          "param_numel",
          [](const ZeroOptimizer& self, size_t group) {
            return self.layout().group(group).param_numel();
          },
          py::arg("group"));
}
