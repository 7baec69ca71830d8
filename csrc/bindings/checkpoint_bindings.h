// Internal to csrc/bindings: the checkpoint methods of the bound classes.
#pragma once

#include "no_gil_delete.h"
#include "zeroshard/engine.h"
#include "zeroshard/zero_optimizer.h"

#include <pybind11/pybind11.h>

namespace zeroshard {

void bind_optimizer_checkpoint(pybind11::class_<ZeroOptimizer, NoGilHolder<ZeroOptimizer>>& cls);
void bind_engine_checkpoint(pybind11::class_<Engine>& cls);
void bind_checkpoint_io(pybind11::module_& m);

}  // namespace zeroshard
