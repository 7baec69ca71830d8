// Checkpoints for Python: python/zeroshard/checkpoint.py, optimizer.py and
// engine.py. JSON crosses as text, files as bytes.
#include "zeroshard/crc32c.h"
#include "zeroshard/safetensors.h"

#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

// After torch's pybind11 setup above.
#include "checkpoint_bindings.h"

namespace py = pybind11;

namespace zeroshard {
namespace {

CheckpointFiles files_from(const py::dict& files) {
  CheckpointFiles out;
  for (const auto& [name, content] : files) {
    out[name.cast<std::string>()] = content.cast<std::string>();
  }
  return out;
}

py::dict files_to_python(const CheckpointFiles& files) {
  py::dict out;
  for (const auto& [name, content] : files) {
    out[py::str(name)] = py::bytes(content);
  }
  return out;
}

CheckpointSaveOptions save_options(const std::string& replicated_json,
                                   const py::dict& replicated_files, const py::dict& rank_files) {
  CheckpointSaveOptions options;
  options.replicated(nlohmann::json::parse(replicated_json.empty() ? "{}" : replicated_json));
  options.replicated_files(files_from(replicated_files));
  options.rank_files(files_from(rank_files));
  return options;
}

py::dict loaded_to_python(const LoadedCheckpoint& loaded) {
  py::dict out;
  out["path"] = loaded.path;
  out["index"] = loaded.index.dump();
  out["replicated_files"] = files_to_python(loaded.replicated_files);
  out["rank_files"] = files_to_python(loaded.rank_files);
  return out;
}

}  // namespace

void bind_optimizer_checkpoint(py::class_<ZeroOptimizer, NoGilHolder<ZeroOptimizer>>& cls) {
  cls.def("set_parameter_names", &ZeroOptimizer::set_parameter_names, py::arg("named"))
      .def("parameter_name", &ZeroOptimizer::parameter_name, py::arg("group"), py::arg("index"))
      .def(
          "save_checkpoint",
          [](ZeroOptimizer& self, const std::string& path, const std::string& replicated_json,
             const py::dict& replicated_files, const py::dict& rank_files, bool async_save) {
            CheckpointSaveOptions options =
                save_options(replicated_json, replicated_files, rank_files);
            options.async_save(async_save);
            py::gil_scoped_release release;
            self.save_checkpoint(path, options);
          },
          py::arg("path"), py::arg("replicated_json") = "",
          py::arg("replicated_files") = py::dict(), py::arg("rank_files") = py::dict(),
          py::arg("async_save") = false)
      .def("wait_for_checkpoint", &ZeroOptimizer::wait_for_checkpoint,
           py::call_guard<py::gil_scoped_release>())
      .def("checkpoint_in_flight", &ZeroOptimizer::checkpoint_in_flight)
      .def(
          "load_checkpoint",
          [](ZeroOptimizer& self, const std::string& path, bool load_optimizer_states) {
            LoadedCheckpoint loaded;
            {
              py::gil_scoped_release release;
              loaded = self.load_checkpoint(
                  path, CheckpointLoadOptions().load_optimizer_states(load_optimizer_states));
            }
            return loaded_to_python(loaded);
          },
          py::arg("path"), py::arg("load_optimizer_states") = true)
      .def("group_hyperparameters", [](const ZeroOptimizer& self) {
        nlohmann::json groups = nlohmann::json::array();
        for (const auto& group : self.param_groups()) {
          groups.push_back(inner_options_to_json(self.inner_kind(), group.options()));
        }
        return groups.dump();
      });
}

void bind_engine_checkpoint(py::class_<Engine>& cls) {
  cls.def(
         "save_checkpoint",
         [](Engine& self, const std::string& save_dir, const std::string& tag,
            const py::dict& replicated_files, const py::dict& rank_files, bool save_latest,
            bool async_save) {
           CheckpointSaveOptions options = save_options("", replicated_files, rank_files);
           options.async_save(async_save);
           py::gil_scoped_release release;
           return self.save_checkpoint(save_dir, tag, nlohmann::json::object(), options,
                                       save_latest);
         },
         py::arg("save_dir"), py::arg("tag") = "", py::arg("replicated_files") = py::dict(),
         py::arg("rank_files") = py::dict(), py::arg("save_latest") = true,
         py::arg("async_save") = false)
      .def(
          "load_checkpoint",
          [](Engine& self, const std::string& load_dir, const std::string& tag,
             bool load_optimizer_states, bool load_lr_scheduler_states, bool load_module_only) {
            LoadedCheckpoint loaded;
            {
              py::gil_scoped_release release;
              self.load_checkpoint(load_dir, tag,
                                   EngineLoadOptions()
                                       .load_optimizer_states(load_optimizer_states)
                                       .load_lr_scheduler_states(load_lr_scheduler_states)
                                       .load_module_only(load_module_only),
                                   &loaded);
            }
            return loaded_to_python(loaded);
          },
          py::arg("load_dir"), py::arg("tag") = "", py::arg("load_optimizer_states") = true,
          py::arg("load_lr_scheduler_states") = true, py::arg("load_module_only") = false);
}

void bind_checkpoint_io(py::module_& m) {
  m.def(
      "crc32c",
      [](const py::buffer& data) {
        const py::buffer_info info = data.request();
        return crc32c(info.ptr, static_cast<size_t>(info.size * info.itemsize));
      },
      py::arg("data"), "CRC-32C of a bytes-like object (the checksum checkpoints store).");
  m.def("read_latest_tag", &read_latest_tag, py::arg("dir"));
  py::class_<SafetensorsWriter>(m, "SafetensorsWriter")
      .def(
          py::init([](const std::string& path,
                      const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>>&
                          entries,
                      const std::map<std::string, std::string>& metadata) {
            std::vector<SafetensorsEntry> list;
            for (const auto& [name, dtype, shape] : entries) {
              list.push_back({name, safetensors_dtype(dtype), shape});
            }
            return std::make_unique<SafetensorsWriter>(path, std::move(list), metadata);
          }),
          py::arg("path"), py::arg("entries"),
          py::arg("metadata") = std::map<std::string, std::string>())
      .def(
          "append", [](SafetensorsWriter& self, const at::Tensor& tensor) { self.append(tensor); },
          py::arg("tensor"), py::call_guard<py::gil_scoped_release>())
      .def("finish", &SafetensorsWriter::finish, py::call_guard<py::gil_scoped_release>());
}

}  // namespace zeroshard
