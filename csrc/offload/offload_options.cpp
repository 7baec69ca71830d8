#include "zeroshard/offload_options.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace zeroshard {
namespace {

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

}  // namespace

OffloadDevice parse_offload_device(const std::string& name) {
  const std::string key = lower(name);
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
