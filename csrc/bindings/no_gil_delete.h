// A pybind11 holder that destroys its object with the GIL released.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

namespace zeroshard {

// A ZeroOptimizer may hold the last reference to its process group, and
// destroying a Gloo group joins its worker threads, which may need the GIL to
// free a tensor that has a Python object: holding the GIL there deadlocks
// (and aborts during interpreter exit). torch binds ProcessGroup the same way.
template <typename T>
struct DeleteWithoutGil {
  void operator()(T* object) const {
    if (PyGILState_Check() != 0) {
      pybind11::gil_scoped_release release;
      delete object;
    } else {
      delete object;
    }
  }
};

template <typename T>
using NoGilHolder = std::unique_ptr<T, DeleteWithoutGil<T>>;

}  // namespace zeroshard
