#include "zeroshard/unit_module.h"

namespace zeroshard {

std::vector<ParameterUnit> collect_units(torch::nn::Module& model) {
  std::vector<ParameterUnit> units;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    if (dynamic_cast<UnitModuleBase*>(item.value().get()) != nullptr) {
      units.push_back(
          ParameterUnit{item.key().empty() ? "<root>" : item.key(), item.value()->parameters()});
    }
  }
  return units;
}

void attach_units(torch::nn::Module& model, ZeroOptimizer& optimizer) {
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    if (auto* unit = dynamic_cast<UnitModuleBase*>(item.value().get())) {
      unit->attach(&optimizer, optimizer.unit_index(item.key().empty() ? "<root>" : item.key()));
    }
  }
  optimizer.broadcast_buffers(model.buffers());
}

}  // namespace zeroshard
