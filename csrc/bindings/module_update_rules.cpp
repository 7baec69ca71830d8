// UpdateRule (update_rule.h) for Python: a rule written in Python (a
// subclass of _C.UpdateRule; zeroshard/update_rules.py runs a torch.optim
// class) is called from the step with the GIL taken for the call, and its
// pieces (ParameterShard) reach it as objects with tensor fields. The
// hyper-parameters cross as JSON text: the Python layer's json module reads
// and writes them, so every value JSON can hold crosses unchanged.
#include "options_from_python.h"

#include "zeroshard/muon_rule.h"
#include "zeroshard/update_rule.h"

#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

namespace py = pybind11;

namespace zeroshard {
namespace {

class PythonUpdateRule : public UpdateRule {
 public:
  std::string name() const override {
    py::gil_scoped_acquire gil;
    return call("name").cast<std::string>();
  }
  std::vector<std::string> state_names(const nlohmann::json& hyperparameters) const override {
    py::gil_scoped_acquire gil;
    return call("state_names", hyperparameters.dump()).cast<std::vector<std::string>>();
  }
  void validate(const nlohmann::json& hyperparameters) const override {
    py::gil_scoped_acquire gil;
    call("validate", hyperparameters.dump());
  }
  void check_parameter(const std::vector<int64_t>& sizes,
                       const nlohmann::json& hyperparameters) const override {
    py::gil_scoped_acquire gil;
    call("check_parameter", sizes, hyperparameters.dump());
  }
  bool whole_parameters(const nlohmann::json& hyperparameters) const override {
    py::gil_scoped_acquire gil;
    return call("whole_parameters", hyperparameters.dump()).cast<bool>();
  }
  std::vector<ParameterStateSpec> parameter_states(
      const std::vector<int64_t>& sizes, const nlohmann::json& hyperparameters) const override {
    py::gil_scoped_acquire gil;
    // Optional in Python: a class that does not define it keeps none.
    if (!py::get_override(static_cast<const UpdateRule*>(this), "parameter_states")) {
      return {};
    }
    std::vector<ParameterStateSpec> out;
    for (const auto& item : call("parameter_states", sizes, hyperparameters.dump())) {
      const auto pair = item.cast<std::pair<std::string, std::vector<int64_t>>>();
      out.push_back({pair.first, pair.second});
    }
    return out;
  }
  double update_cost(const std::vector<int64_t>& sizes,
                     const nlohmann::json& hyperparameters) const override {
    py::gil_scoped_acquire gil;
    // Optional in Python: a class that does not say costs its elements.
    if (!py::get_override(static_cast<const UpdateRule*>(this), "update_cost")) {
      return UpdateRule::update_cost(sizes, hyperparameters);
    }
    return call("update_cost", sizes, hyperparameters.dump()).cast<double>();
  }
  void update(const nlohmann::json& hyperparameters, std::vector<ParameterShard>& shards) override {
    py::gil_scoped_acquire gil;
    py::list pieces;
    for (ParameterShard& piece : shards) {
      pieces.append(py::cast(&piece, py::return_value_policy::reference));
    }
    call("update", hyperparameters.dump(), pieces);
  }

 private:
  // A Python exception inside the rule becomes the core's error, with its
  // message: the step then fails on every rank as any error of the update
  // does, instead of a Python error crossing C++ frames without the GIL.
  template <typename... Args>
  py::object call(const char* method, Args&&... args) const {
    py::function override = py::get_override(static_cast<const UpdateRule*>(this), method);
    TORCH_CHECK_TYPE(override, "the update rule does not define ", method, "()");
    try {
      return override(std::forward<Args>(args)...);
    } catch (py::error_already_set& e) {
      // The exception's own message: what() adds the type and a traceback.
      const std::string what = py::str(e.value()).cast<std::string>();
      const bool value_error = e.matches(PyExc_ValueError);
      const bool type_error = e.matches(PyExc_TypeError);
      TORCH_CHECK_VALUE(!value_error, what);
      TORCH_CHECK_TYPE(!type_error, what);
      TORCH_CHECK(false, what);
    }
  }
};

}  // namespace

nlohmann::json json_from_python(const py::handle& values) {
  const std::string text = py::module_::import("json").attr("dumps")(values).cast<std::string>();
  return nlohmann::json::parse(text);
}

void bind_update_rules(py::module_& m) {
  py::class_<ParameterShard>(m, "ParameterShard",
                             "One piece of one parameter an update rule updates (update_rule.h).")
      .def_readonly("group", &ParameterShard::group)
      .def_readonly("parameter", &ParameterShard::parameter)
      .def_readonly("param_offset", &ParameterShard::param_offset)
      .def_readonly("sizes", &ParameterShard::sizes)
      .def_readonly("step", &ParameterShard::step)
      .def_readonly("param", &ParameterShard::param)
      .def_readonly("grad", &ParameterShard::grad)
      .def_readonly("states", &ParameterShard::states)
      .def_readonly("parameter_states", &ParameterShard::parameter_states);
  py::class_<UpdateRule, PythonUpdateRule, std::shared_ptr<UpdateRule>>(
      m, "UpdateRule",
      "An elementwise update rule run on this rank's pieces of the parameters "
      "(update_rule.h). Subclasses define name(), state_names(hyperparameters_json), "
      "validate(hyperparameters_json), check_parameter(sizes, hyperparameters_json), "
      "whole_parameters(hyperparameters_json) and update(hyperparameters_json, pieces); "
      "optionally update_cost(sizes, hyperparameters_json), a whole-parameter rule's work "
      "on one parameter (default: its elements), which balances the owners, and "
      "parameter_states(sizes, hyperparameters_json), [(name, sizes)] of the states it keeps "
      "in shapes of their own (default: none).")
      .def(py::init<>())
      // A C++ rule's own answers (MuonRule), for the Python layer and the
      // estimator; a Python subclass's methods take their place.
      .def("name", &UpdateRule::name)
      .def("state_names",
           [](const UpdateRule& rule, const std::string& hyperparameters) {
             return rule.state_names(nlohmann::json::parse(hyperparameters));
           })
      .def("whole_parameters",
           [](const UpdateRule& rule, const std::string& hyperparameters) {
             return rule.whole_parameters(nlohmann::json::parse(hyperparameters));
           })
      .def("update_cost", [](const UpdateRule& rule, const std::vector<int64_t>& sizes,
                             const std::string& hyperparameters) {
        return rule.update_cost(sizes, nlohmann::json::parse(hyperparameters));
      });
  py::class_<MuonRule, UpdateRule, std::shared_ptr<MuonRule>>(
      m, "MuonRule", "torch.optim.Muon as the core's C++ rule (muon_rule.h).")
      .def(py::init<>())
      .def_static(
          "defaults", [] { return MuonOptions().rule_options().hyperparameters().dump(); },
          "torch.optim.Muon's hyper-parameters with their defaults, as JSON.");
  m.def(
      "rule_update",
      [](const std::shared_ptr<UpdateRule>& rule, const std::string& hyperparameters,
         const at::Tensor& param, const at::Tensor& grad, const std::vector<at::Tensor>& states,
         int64_t step) {
        const nlohmann::json h = nlohmann::json::parse(hyperparameters);
        std::vector<ParameterShard> pieces(1);
        ParameterShard& piece = pieces[0];
        piece.sizes = param.sizes().vec();
        piece.step = step;
        piece.param = param.view({-1});
        piece.grad = grad.reshape({-1});
        for (const at::Tensor& state : states) {
          piece.states.push_back(state.view({-1}));
        }
        rule->check_parameter(piece.sizes, h);
        py::gil_scoped_release release;
        rule->update(h, pieces);
      },
      py::arg("rule"), py::arg("hyperparameters"), py::arg("param"), py::arg("grad"),
      py::arg("states"), py::arg("step"),
      "One update by `rule` of one whole parameter and its states, in place (for tests).");
}

}  // namespace zeroshard
