#include "options_from_python.h"

#include "zeroshard/update_rule.h"

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
    case InnerOptimizerKind::kRule:
      static_cast<RuleOptions&>(options).hyperparameters() = json_from_python(values);
      break;
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
  std::unique_ptr<torch::optim::OptimizerOptions> options = default_inner_options(kind);
  apply_hyperparameters(kind, *options, values);
  return options;
}

// torch.optim's order of the keys (the param_groups' order), values from
// default_inner_options.
py::dict inner_optimizer_default_dicts() {
  py::dict out;
  auto adam_like = [](const auto& o) {
    py::dict d;
    d["lr"] = o.lr();
    d["betas"] = py::make_tuple(std::get<0>(o.betas()), std::get<1>(o.betas()));
    d["eps"] = o.eps();
    d["weight_decay"] = o.weight_decay();
    d["amsgrad"] = o.amsgrad();
    return d;
  };
  const auto adam = default_inner_options(InnerOptimizerKind::kAdam);
  const auto adamw = default_inner_options(InnerOptimizerKind::kAdamW);
  const auto sgd_options = default_inner_options(InnerOptimizerKind::kSGD);
  out["adam"] = adam_like(static_cast<const torch::optim::AdamOptions&>(*adam));
  out["adamw"] = adam_like(static_cast<const torch::optim::AdamWOptions&>(*adamw));
  const auto& o = static_cast<const torch::optim::SGDOptions&>(*sgd_options);
  py::dict sgd;
  sgd["lr"] = o.lr();
  sgd["momentum"] = o.momentum();
  sgd["dampening"] = o.dampening();
  sgd["weight_decay"] = o.weight_decay();
  sgd["nesterov"] = o.nesterov();
  out["sgd"] = sgd;
  return out;
}

// An offload section (offload_optimizer / offload_param) from the Python
// layer's dict, keys already checked there ([Note: one list of the offload
// keys] in offload_options.h; the ignored DeepSpeed keys are dropped there).
OffloadOptions offload_options_from(const py::dict& values) {
  OffloadOptions options;
  for (const auto& item : values) {
    const auto key = item.first.cast<std::string>();
    const py::handle value = item.second;
    bool known = key == "device";
    if (known) {
      options.device(parse_offload_device(value.cast<std::string>()));
    }
    for_each_offload_option(options, [&](const OffloadOptionInfo& info, auto& field) {
      if (key == info.name) {
        field = value.cast<std::decay_t<decltype(field)>>();
        known = true;
      }
    });
    TORCH_CHECK_TYPE(known, "unknown offload option '", key, "'");
  }
  return options;
}

// DeepSpeed's "aio" section from the Python layer's dict.
AioOptions aio_options_from(const py::dict& values) {
  AioOptions options;
  std::string expected;
  for_each_aio_option(options, [&](const AioOptionInfo& info, const auto&) {
    expected += (expected.empty() ? "" : ", ") + std::string(info.name);
  });
  for (const auto& item : values) {
    const auto key = item.first.cast<std::string>();
    const py::handle value = item.second;
    bool known = false;
    for_each_aio_option(options, [&](const AioOptionInfo& info, auto& field) {
      if (key == info.name || (*info.alias != '\0' && key == info.alias)) {
        field = value.cast<std::decay_t<decltype(field)>>();
        known = true;
      }
    });
    TORCH_CHECK_TYPE(known, "unknown aio option '", key, "'; expected one of ", expected);
  }
  return options;
}

py::dict offload_section_dict(const OffloadOptions& options, unsigned section) {
  py::dict out;
  out["device"] = offload_device_name(options.device());
  for_each_offload_option(options, [&](const OffloadOptionInfo& info, const auto& value) {
    if ((info.sections & section) != 0) {
      out[info.name] = value;
    }
  });
  return out;
}

py::dict aio_dict(const AioOptions& options) {
  py::dict out;
  for_each_aio_option(
      options, [&](const AioOptionInfo& info, const auto& value) { out[info.name] = value; });
  return out;
}

py::dict offload_option_keys() {
  py::dict out;
  for (const auto& [name, section] :
       {std::pair<const char*, OffloadSection>{"offload_optimizer", kOffloadOptimizerSection},
        std::pair<const char*, OffloadSection>{"offload_param", kOffloadParamSection}}) {
    out[name] = offload_section_dict(offload_section_defaults(section), section);
  }
  const AioOptions aio_defaults;
  py::dict aio = aio_dict(aio_defaults);
  for_each_aio_option(aio_defaults, [&](const AioOptionInfo& info, const auto& value) {
    if (*info.alias != '\0') {
      aio[info.alias] = value;
    }
  });
  out["aio"] = aio;
  return out;
}

py::dict offload_ignored_keys() {
  py::dict out;
  for (const auto& [name, section] :
       {std::pair<const char*, OffloadSection>{"offload_optimizer", kOffloadOptimizerSection},
        std::pair<const char*, OffloadSection>{"offload_param", kOffloadParamSection}}) {
    py::list keys;
    for_each_ignored_offload_key([&](const char* key, unsigned sections, auto) {
      if ((sections & section) != 0) {
        keys.append(key);
      }
    });
    out[name] = keys;
  }
  out["aio"] = py::list();
  return out;
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
