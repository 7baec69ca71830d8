// See gloo_process_group.h for why this file is separate.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include "zeroshard/gloo_process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace zeroshard {

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t world_size,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(world_size >= 1, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "rank must be in [0, ", world_size, "), got ",
                    rank);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank),
                                                             static_cast<int>(world_size), options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, static_cast<int>(rank),
                                                       static_cast<int>(world_size));
  // Gloo serves CPU tensors, and CUDA tensors by staging them through host
  // memory where torch was built with CUDA.
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  return group;
}

}  // namespace zeroshard
