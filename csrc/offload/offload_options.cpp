#include "zeroshard/offload_options.h"
#include "zeroshard/text.h"

#include <c10/util/Exception.h>

namespace zeroshard {

OffloadDevice parse_offload_device(const std::string& name) {
  const std::string key = lowercase(name);
  if (key == "none" || key.empty()) {
    return OffloadDevice::kNone;
  }
  if (key == "cpu") {
    return OffloadDevice::kCPU;
  }
  if (key == "nvme") {
    return OffloadDevice::kNVMe;
  }
  TORCH_CHECK_VALUE(false, "unknown offload device '", name, "'; expected 'none', 'cpu' or 'nvme'");
}

const char* offload_device_name(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCPU:
      return "cpu";
    case OffloadDevice::kNVMe:
      return "nvme";
  }
  return "unknown";
}

}  // namespace zeroshard
