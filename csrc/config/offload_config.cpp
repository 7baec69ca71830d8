// DeepSpeed's offload_optimizer / offload_param sections and its "aio"
// section: where the state goes and how the NVMe tier does its I/O.
#include "config_section.h"

namespace zeroshard::config_detail {
namespace {

// A section's keys, from [Note: one list of the offload keys].
Keys offload_keys(unsigned section) {
  Keys keys = {"device"};
  const OffloadOptions defaults;
  for_each_offload_option(defaults, [&](const OffloadOptionInfo& info, const auto&) {
    if ((info.sections & section) != 0) {
      keys.emplace_back(info.name);
    }
  });
  for_each_ignored_offload_key([&](const char* name, unsigned sections, auto) {
    if ((sections & section) != 0) {
      keys.emplace_back(name);
    }
  });
  return keys;
}

Keys aio_keys() {
  Keys keys;
  const AioOptions defaults;
  for_each_aio_option(defaults, [&](const AioOptionInfo& info, const auto&) {
    if (info.in_config) {
      keys.emplace_back(info.name);
      if (*info.alias != '\0') {
        keys.emplace_back(info.alias);
      }
    }
  });
  keys.emplace_back("use_gds");
  return keys;
}

// One value of a section by its type, `fallback` where the section leaves
// it out; numbers within [least, most].
bool read_value(const Section& s, const char* key, bool fallback, double, double) {
  return s.boolean(key, fallback);
}
double read_value(const Section& s, const char* key, double fallback, double least, double most) {
  return s.number(key, fallback, least, most);
}
int64_t read_value(const Section& s, const char* key, int64_t fallback, double least, double most) {
  return s.integer(key, fallback, static_cast<int64_t>(least),
                   most >= kNoUpperBound ? kNoMax : static_cast<int64_t>(most));
}
std::string read_value(const Section& s, const char* key, const std::string& fallback, double,
                       double) {
  return s.string(key, fallback);
}

}  // namespace

// DeepSpeed's offload section into OffloadOptions (DeepSpeed's defaults for
// what the section leaves out, except that the NVMe step pipelines unless
// pipeline_read/pipeline_write say false).
OffloadOptions read_offload(const Section& zero, const std::string& key, bool pin_default,
                            DeepSpeedConfig& out, OffloadDevice* written) {
  const bool optimizer = key == "offload_optimizer";
  const Section s =
      zero.section(key, offload_keys(optimizer ? kOffloadOptimizerSection : kOffloadParamSection));
  const std::string device =
      s.is_auto("device") ? "auto" : s.choice("device", "none", {"none", "cpu", "nvme"});
  if (device == "auto") {
    (optimizer ? out.offload_optimizer_auto : out.offload_param_auto) = true;
  }
  *written = device == "auto" ? OffloadDevice::kNone : parse_offload_device(device);
  // What the section leaves out keeps OffloadOptions' defaults (DeepSpeed's,
  // but for the NVMe pipelining, on unless pipeline_read/pipeline_write say
  // false), and offload_param's buffer_count is DeepSpeed's 5 there; the
  // keys, types and ranges are [Note: one list of the offload keys].
  const OffloadSection section = optimizer ? kOffloadOptimizerSection : kOffloadParamSection;
  OffloadOptions options = offload_section_defaults(section);
  options.pin_memory(pin_default);
  for_each_offload_option(options, [&](const OffloadOptionInfo& info, auto& field) {
    if ((info.sections & section) != 0) {
      field = read_value(s, info.name, field, info.least, info.most);
    }
  });
  // DeepSpeed's keys zeroshard does not use: checked for type, then dropped.
  for_each_ignored_offload_key([&](const char* name, unsigned sections, auto value) {
    if ((sections & section) != 0) {
      read_value(s, name, value, 0, 1);
    }
  });
  if (device == "nvme") {
    TORCH_CHECK_VALUE(!options.nvme_path().empty(), s.path("nvme_path"),
                      " is needed with device \"nvme\": a directory on the disk to swap to");
  }
  TORCH_CHECK_VALUE(!options.swap_gradients() || device == "nvme", s.path("swap_gradients"),
                    " puts the gradient shard in the NVMe swap space and needs device \"nvme\"; "
                    "device is \"",
                    device, "\"");
  if ((device == "cpu" || device == "nvme") && !optimizer && out.zero_stage != 3 &&
      !out.stage_auto) {
    TORCH_CHECK_VALUE(false, s.path("device"), " = \"", device,
                      "\" offloads parameter shards, which needs ZeRO stage 3 (as in "
                      "DeepSpeed); zero_optimization.stage is ",
                      out.zero_stage);
  }
  options.device(device == "auto" ? OffloadDevice::kNone : parse_offload_device(device));
  return options;
}

void read_aio(const Section& top, DeepSpeedConfig& out) {
  const Section aio = top.section("aio", aio_keys());
  AioOptions& io = out.zero.aio();
  for_each_aio_option(io, [&](const AioOptionInfo& info, auto& field) {
    if (info.in_config) {
      // The other spelling is read where the section has no key of the name.
      const char* key = *info.alias != '\0' && !aio.has(info.name) ? info.alias : info.name;
      field = read_value(aio, key, field, static_cast<double>(info.least),
                         info.most == 0 ? kNoUpperBound : static_cast<double>(info.most));
    }
  });
  if (aio.boolean("use_gds", false)) {
    flag(out, aio.path("use_gds"), true,
         "GPUDirect Storage is not used; ignoring it reads through host memory");
  }
  check_aio_options(io);
}

}  // namespace zeroshard::config_detail
