// Stage 3 for Python models: forward hooks on torch.nn.Module that call the
// C++ core's unit hooks. The Python layer picks the units (wrap policy); the
// gather/release/prefetch logic is all in ParameterGatherer.
#include "zeroshard/parameter_gatherer.h"
#include "zeroshard/zero_optimizer.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace zeroshard {
namespace {

// The tensors in a module's output: a tensor, or tuples, lists and dict
// values of them, nested.
void collect_tensors(py::handle value, std::vector<at::Tensor>& out) {
  if (THPVariable_Check(value.ptr())) {
    out.push_back(THPVariable_Unpack(value.ptr()));
  } else if (py::isinstance<py::tuple>(value) || py::isinstance<py::list>(value)) {
    for (py::handle item : value) {
      collect_tensors(item, out);
    }
  } else if (py::isinstance<py::dict>(value)) {
    for (const auto& item : value.cast<py::dict>()) {
      collect_tensors(item.second, out);
    }
  }
}

// Registers the pre- and post-forward hooks of `unit` on `module`; returns
// their RemovableHandles. The hooks keep the optimizer object alive, so a
// model outliving the Python optimizer still runs safely.
py::list register_unit_hooks(py::object optimizer, py::object module, int64_t unit) {
  auto& self = optimizer.cast<ZeroOptimizer&>();
  TORCH_CHECK_INDEX(unit >= 0 && unit < self.num_units(), "unit ", unit, " out of range [0, ",
                    self.num_units(), ")");
  py::cpp_function pre_hook([optimizer, unit](py::object, py::object) {
    auto& opt = optimizer.cast<ZeroOptimizer&>();
    py::gil_scoped_release release;  // see [Note: GIL and collectives] in module.cpp
    opt.unit_pre_forward(unit);
  });
  // With always_call, torch passes output=None when the forward raised.
  py::cpp_function post_hook([optimizer, unit](py::object, py::object, py::object output) {
    auto& opt = optimizer.cast<ZeroOptimizer&>();
    std::vector<at::Tensor> tensors;
    collect_tensors(output, tensors);
    py::gil_scoped_release release;
    for (const auto& tensor : tensors) {
      opt.unit_track_output(unit, tensor);
    }
    opt.unit_post_forward(unit);
  });
  // The gather runs before any pre-hook the user registered (they may read the
  // parameters), and the release runs even when the forward raises, so an
  // exception does not leave the unit referenced for good.
  py::list handles;
  handles.append(module.attr("register_forward_pre_hook")(pre_hook, py::arg("prepend") = true));
  handles.append(module.attr("register_forward_hook")(post_hook, py::arg("always_call") = true));
  return handles;
}

// The model's own forward: the agreement's barrier at its end (see
// ZeroOptimizer::model_forward_begin).
py::list register_model_forward_hooks(py::object optimizer, py::object module) {
  // The exception being handled when each (possibly nested) forward began:
  // a forward called from inside an except clause is not one that raised.
  py::list handled_at_entry;
  auto handled_now = [] { return py::module_::import("sys").attr("exc_info")()[py::int_(1)]; };
  py::cpp_function pre_hook(
      [optimizer, handled_at_entry, handled_now](py::object, py::object) mutable {
        handled_at_entry.append(handled_now());
        optimizer.cast<ZeroOptimizer&>().model_forward_begin();
      });
  py::cpp_function post_hook([optimizer, handled_at_entry, handled_now](py::object, py::object,
                                                                        py::object output) mutable {
    auto& opt = optimizer.cast<ZeroOptimizer&>();
    py::object at_entry = py::none();
    if (py::len(handled_at_entry) > 0) {
      at_entry = handled_at_entry.attr("pop")();
    }
    // With always_call, torch runs this hook from its except clause when the
    // forward raised: output None and an exception handled that was not
    // handled already when the forward began.
    const py::object handled = handled_now();
    const bool raised = output.is_none() && !handled.is_none() && !handled.is(at_entry);
    py::gil_scoped_release release;
    opt.model_forward_end(raised);
  });
  py::list handles;
  handles.append(module.attr("register_forward_pre_hook")(pre_hook, py::arg("prepend") = true));
  handles.append(module.attr("register_forward_hook")(post_hook, py::arg("always_call") = true));
  return handles;
}

}  // namespace

void bind_module_hooks(py::module_& m) {
  m.def("register_model_forward_hooks", &register_model_forward_hooks, py::arg("optimizer"),
        py::arg("module"), "Registers the stage 3 end-of-forward agreement on the model `module`.");
  m.def("register_unit_hooks", &register_unit_hooks, py::arg("optimizer"), py::arg("module"),
        py::arg("unit"), "Registers the stage 3 gather/release hooks of `unit` on `module`.");
}

}  // namespace zeroshard
