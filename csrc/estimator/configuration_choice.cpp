// choose_configuration: what "auto" in a config resolves to (see
// memory_estimator.h). The estimates are estimate_memory's; this file only
// orders the candidates and checks them against what is free.
#include "zeroshard/memory_estimator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

namespace zeroshard {
namespace {

std::string bytes_text(double bytes) {
  char text[32];
  if (bytes >= 1e9) {
    std::snprintf(text, sizeof(text), "%.2f GB", bytes / 1e9);
  } else {
    std::snprintf(text, sizeof(text), "%.1f MB", bytes / 1e6);
  }
  return text;
}

struct Candidate {
  int64_t stage;
  OffloadDevice optimizer;
  OffloadDevice param;
};

// Communication and speed cost of an offload: none < CPU < NVMe, the
// optimizer state (updated once per step) before the parameters (read at
// every gather).
int offload_cost(const Candidate& c) {
  auto cost = [](OffloadDevice device, int cpu, int nvme) {
    return device == OffloadDevice::kCPU ? cpu : device == OffloadDevice::kNVMe ? nvme : 0;
  };
  return cost(c.optimizer, 1, 3) + cost(c.param, 2, 4);
}

std::vector<Candidate> candidates(const FixedSettings& fixed, bool nvme_allowed) {
  const OffloadDevice devices[] = {OffloadDevice::kNone, OffloadDevice::kCPU, OffloadDevice::kNVMe};
  std::vector<Candidate> out;
  for (int64_t stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice optimizer : devices) {
      for (OffloadDevice param : devices) {
        const Candidate c{stage, optimizer, param};
        const bool valid = (param == OffloadDevice::kNone || stage == 3) &&
                           (param != OffloadDevice::kNVMe || optimizer != OffloadDevice::kNone);
        const bool uses_nvme = optimizer == OffloadDevice::kNVMe || param == OffloadDevice::kNVMe;
        const bool nvme_paths = (optimizer != OffloadDevice::kNVMe || fixed.optimizer_nvme) &&
                                (param != OffloadDevice::kNVMe || fixed.param_nvme);
        const bool matches = (!fixed.stage || *fixed.stage == stage) && stage >= fixed.min_stage &&
                             (!fixed.offload_optimizer || *fixed.offload_optimizer == optimizer) &&
                             (!fixed.offload_param || *fixed.offload_param == param);
        if (valid && matches && nvme_paths && (nvme_allowed || !uses_nvme)) {
          out.push_back(c);
        }
      }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    return std::make_tuple(offload_cost(a), a.stage) < std::make_tuple(offload_cost(b), b.stage);
  });
  return out;
}

}  // namespace

Recommendation choose_configuration(const EstimateOptions& options,
                                    const AvailableMemory& available, const FixedSettings& fixed) {
  TORCH_CHECK_VALUE(available.host_bytes > 0, "the host memory available must be > 0 bytes, got ",
                    available.host_bytes);
  TORCH_CHECK_VALUE(available.device_is_host || available.device_bytes > 0,
                    "the device memory available must be > 0 bytes, got ", available.device_bytes);
  const bool nvme_allowed = available.nvme_bytes >= 0;
  const std::vector<Candidate> tried = candidates(fixed, nvme_allowed);
  TORCH_CHECK_VALUE(
      !tried.empty(), "no configuration matches the settings the config fixes",
      nvme_allowed ? "" : " (NVMe offload needs an nvme_path that exists on every rank)");
  const double ranks = static_cast<double>(options.ranks_per_node());
  Recommendation best;
  std::string rejected;
  std::string shortfall;
  for (const Candidate& c : tried) {
    EstimateOptions candidate = options;
    candidate.offload_optimizer(c.optimizer).offload_param(c.param);
    const MemoryEstimate e = estimate_memory(c.stage, candidate);
    const std::string name = describe_configuration(c.stage, c.optimizer, c.param);
    // Per node, in the RAM the ranks share (with the device's bytes on a CPU device).
    const double host_need =
        e.cpu_bytes_per_node + (available.device_is_host ? e.device_bytes * ranks : 0);
    std::vector<std::string> short_of;
    std::string needs;
    if (!available.device_is_host) {
      needs = bytes_text(e.device_bytes) + " of " + bytes_text(available.device_bytes) +
              " device memory per rank, ";
      if (e.device_bytes > available.device_bytes) {
        short_of.push_back("device memory by " +
                           bytes_text(e.device_bytes - available.device_bytes) + " per rank");
      }
    }
    needs +=
        bytes_text(host_need) + " of " + bytes_text(available.host_bytes) + " host memory per node";
    if (host_need > available.host_bytes) {
      short_of.push_back("host memory by " + bytes_text(host_need - available.host_bytes) +
                         " per node");
    }
    if (e.nvme_bytes_per_node > 0) {
      needs += ", " + bytes_text(e.nvme_bytes_per_node) + " of " +
               bytes_text(std::max(0.0, available.nvme_bytes)) + " free at nvme_path";
      if (e.nvme_bytes_per_node > available.nvme_bytes) {
        short_of.push_back("disk by " + bytes_text(e.nvme_bytes_per_node - available.nvme_bytes));
      }
    }
    best.estimate = e;
    best.offload_optimizer = c.optimizer;
    best.offload_param = c.param;
    if (short_of.empty()) {
      best.fits = true;
      best.reason = name + ": it needs " + needs + "." +
                    (rejected.empty() ? std::string() : " Rejected first: " + rejected + ".");
      return best;
    }
    std::string missing;
    for (const auto& item : short_of) {
      missing += (missing.empty() ? "" : ", ") + item;
    }
    rejected +=
        (rejected.empty() ? "" : "; ") + name + " (needs " + needs + "; short of " + missing + ")";
    shortfall = name + " needs " + needs + ": short of " + missing;
  }
  const bool nvme_tried = nvme_allowed && (fixed.optimizer_nvme || fixed.param_nvme);
  best.reason = "nothing fits: even " + shortfall +
                " (model states, gradient buckets, gathered units and, where given, "
                "activations; " +
                (nvme_tried ? std::string()
                            : "NVMe not tried: no nvme_path given, or not a directory on "
                              "every rank; ") +
                "add ranks or memory)";
  return best;
}

}  // namespace zeroshard
