// Python's forms of the options (dicts of plain values, keys and types
// checked by the Python layer) turned into the core's: the inner optimizers'
// hyper-parameters, ZeroOptions with its offload and aio sections, and the
// scalar options' defaults and descriptions for the Python signature and
// docstring, the offload and aio keys and defaults for the Python layer.
// Internal to csrc/bindings/.
#pragma once

#include "zeroshard/zero_optimizer.h"

#include <torch/csrc/utils/pybind.h>

#include <memory>

namespace zeroshard {

void apply_hyperparameters(InnerOptimizerKind kind, torch::optim::OptimizerOptions& options,
                           const pybind11::dict& values);
std::unique_ptr<torch::optim::OptimizerOptions> make_options(InnerOptimizerKind kind,
                                                             const pybind11::dict& values);
// Plain Python values (a hyper-parameter dict) as JSON, through Python's json
// module: a value it cannot write raises its TypeError.
nlohmann::json json_from_python(const pybind11::handle& values);
ZeroOptions zero_options_from(const pybind11::dict& values);
pybind11::dict zero_option_defaults();
// Each inner optimizer's hyper-parameters with their defaults
// (default_inner_options in inner_optimizer.h), by optimizer name.
pybind11::dict inner_optimizer_default_dicts();
pybind11::dict zero_option_docs();
// [Note: one list of the offload keys] (offload_options.h) for Python: an
// offload section and the aio section as dicts, and each section's keys with
// their defaults (offload_param's buffer_count is kOffloadParamBufferCount;
// aio's other spellings included) and the DeepSpeed keys it accepts unused.
pybind11::dict offload_section_dict(const OffloadOptions& options, unsigned section);
pybind11::dict aio_dict(const AioOptions& options);
pybind11::dict offload_option_keys();
pybind11::dict offload_ignored_keys();

}  // namespace zeroshard
