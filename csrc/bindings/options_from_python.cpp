#include "options_from_python.h"

#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <pybind11/stl.h>

namespace py = pybind11;

namespace zeroshard {

template <typename T>
void set_if_present(const py::dict& values, const char* key, T& target) {
  if (values.contains(key)) {
    target = values[key].cast<T>();
  }
}

// Writes the Python param_group's hyper-parameters into the group's LibTorch
// options. The Python layer passes plain floats and bools.
void apply_hyperparameters(InnerOptimizerKind kind, torch::optim::OptimizerOptions& options,
                           const py::dict& values) {
  auto adam_like = [&](auto& o) {
    set_if_present(values, "lr", o.lr());
    set_if_present(values, "eps", o.eps());
    set_if_present(values, "weight_decay", o.weight_decay());
    set_if_present(values, "amsgrad", o.amsgrad());
    if (values.contains("betas")) {
      auto betas = values["betas"].cast<std::pair<double, double>>();
      o.betas(std::make_tuple(betas.first, betas.second));
    }
  };
  switch (kind) {
    case InnerOptimizerKind::kAdam:
      adam_like(static_cast<torch::optim::AdamOptions&>(options));
      break;
    case InnerOptimizerKind::kAdamW:
      adam_like(static_cast<torch::optim::AdamWOptions&>(options));
      break;
    case InnerOptimizerKind::kSGD: {
      auto& o = static_cast<torch::optim::SGDOptions&>(options);
      set_if_present(values, "lr", o.lr());
      set_if_present(values, "momentum", o.momentum());
      set_if_present(values, "dampening", o.dampening());
      set_if_present(values, "weight_decay", o.weight_decay());
      set_if_present(values, "nesterov", o.nesterov());
      break;
    }
  }
}

std::unique_ptr<torch::optim::OptimizerOptions> make_options(InnerOptimizerKind kind,
                                                             const py::dict& values) {
  std::unique_ptr<torch::optim::OptimizerOptions> options;
  switch (kind) {
    case InnerOptimizerKind::kAdam:
      options = std::make_unique<torch::optim::AdamOptions>();
      break;
    case InnerOptimizerKind::kAdamW:
      options = std::make_unique<torch::optim::AdamWOptions>();
      break;
    case InnerOptimizerKind::kSGD:
      options = std::make_unique<torch::optim::SGDOptions>(0.0);
      break;
  }
  apply_hyperparameters(kind, *options, values);
  return options;
}

// An offload section (offload_optimizer / offload_param) from the Python
// layer's dict, keys already checked there.
OffloadOptions offload_options_from(const py::dict& values) {
  OffloadOptions options;
  for (const auto& item : values) {
    const auto key = item.first.cast<std::string>();
    const py::handle value = item.second;
    if (key == "device") {
      options.device(parse_offload_device(value.cast<std::string>()));
    } else if (key == "pin_memory") {
      options.pin_memory(value.cast<bool>());
    } else if (key == "ratio") {
      options.ratio(value.cast<double>());
    } else if (key == "buffer_count") {
      options.buffer_count(value.cast<int64_t>());
    } else if (key == "buffer_size") {
      options.buffer_size(value.cast<int64_t>());
    } else if (key == "max_in_cpu") {
      options.max_in_cpu(value.cast<int64_t>());
    } else if (key == "nvme_path") {
      options.nvme_path(value.cast<std::string>());
    } else if (key == "pipeline_read") {
      options.pipeline_read(value.cast<bool>());
    } else if (key == "pipeline_write") {
      options.pipeline_write(value.cast<bool>());
    } else if (key == "swap_gradients") {
      options.swap_gradients(value.cast<bool>());
    } else {
      TORCH_CHECK_TYPE(false, "unknown offload option '", key, "'");
    }
  }
  return options;
}

// DeepSpeed's "aio" section from the Python layer's dict.
AioOptions aio_options_from(const py::dict& values) {
  AioOptions options;
  for (const auto& item : values) {
    const auto key = item.first.cast<std::string>();
    const py::handle value = item.second;
    if (key == "block_size") {
      options.block_size(value.cast<int64_t>());
    } else if (key == "queue_depth") {
      options.queue_depth(value.cast<int64_t>());
    } else if (key == "intra_op_parallelism" || key == "thread_count") {
      options.intra_op_parallelism(value.cast<int64_t>());
    } else if (key == "single_submit") {
      options.single_submit(value.cast<bool>());
    } else if (key == "overlap_events") {
      options.overlap_events(value.cast<bool>());
    } else if (key == "use_io_uring") {
      options.use_io_uring(value.cast<bool>());
    } else {
      TORCH_CHECK_TYPE(false, "unknown aio option '", key,
                       "'; expected block_size, queue_depth, intra_op_parallelism, "
                       "single_submit, overlap_events or use_io_uring");
    }
  }
  return options;
}

// ZeroOptions from the Python layer's keyword arguments (already validated
// for type there; ranges are checked by the core).
ZeroOptions zero_options_from(const py::dict& values) {
  ZeroOptions options;
  for (const auto& item : values) {
    const auto key = item.first.cast<std::string>();
    const py::handle value = item.second;
    bool scalar = false;
    for_each_scalar_zero_option(options, [&](const ZeroOptionInfo& info, auto& field) {
      if (key == info.name) {
        field = value.cast<std::decay_t<decltype(field)>>();
        scalar = true;
      }
    });
    if (scalar) {
      continue;
    }
    if (key == "offload_optimizer") {
      options.offload_optimizer(offload_options_from(value.cast<py::dict>()));
    } else if (key == "offload_param") {
      options.offload_param(offload_options_from(value.cast<py::dict>()));
    } else if (key == "aio") {
      options.aio(aio_options_from(value.cast<py::dict>()));
    } else if (key == "materialize_device") {
      options.materialize_device(c10::Device(value.cast<std::string>()));
    } else {
      std::string known = "offload_optimizer, offload_param, aio, materialize_device";
      for_each_scalar_zero_option(options, [&](const ZeroOptionInfo& info, const auto&) {
        known += std::string(", ") + info.name;
      });
      TORCH_CHECK_TYPE(false, "unknown ZeRO option '", key, "'; expected one of ", known);
    }
  }
  return options;
}

// The scalar options' defaults, for the Python signature ([Note: one list of
// the scalar options] in zero_options.h).
py::dict zero_option_defaults() {
  py::dict out;
  const ZeroOptions defaults;
  for_each_scalar_zero_option(
      defaults, [&](const ZeroOptionInfo& info, const auto& value) { out[info.name] = value; });
  return out;
}

// Their one-line descriptions, for the Python docstring.
py::dict zero_option_docs() {
  py::dict out;
  const ZeroOptions defaults;
  for_each_scalar_zero_option(
      defaults, [&](const ZeroOptionInfo& info, const auto&) { out[info.name] = info.doc; });
  return out;
}

}  // namespace zeroshard
