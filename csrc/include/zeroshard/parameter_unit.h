// zeroshard::ParameterUnit: which parameters stage 3 gathers together.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace zeroshard {

// The parameters of one unit, as the user defines it. A parameter may appear
// in several units (tied weights): it is stored with the first unit that
// lists it and gathered for every unit that uses it.
struct ParameterUnit {
  std::string name;
  std::vector<at::Tensor> params;
};

}  // namespace zeroshard
