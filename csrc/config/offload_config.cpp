// DeepSpeed's offload_optimizer / offload_param sections and its "aio"
// section: where the state goes and how the NVMe tier does its I/O.
#include "config_section.h"

namespace zeroshard::config_detail {
namespace {

// clang-format off
const Keys kOffloadOptimizerKeys = {
    "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
    "fast_init", "ratio", "super_offload", "cpuadam_cores_perc", "convert_grad_on_cpu",
    "swap_gradients"};
const Keys kOffloadParamKeys = {
    "device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"};
const Keys kAioKeys = {"block_size", "queue_depth", "intra_op_parallelism", "thread_count",
                       "single_submit", "overlap_events", "use_gds"};
// clang-format on

}  // namespace

// DeepSpeed's offload section into OffloadOptions (DeepSpeed's defaults for
// what the section leaves out, except that the NVMe step pipelines unless
// pipeline_read/pipeline_write say false).
OffloadOptions read_offload(const Section& zero, const std::string& key, bool pin_default,
                            DeepSpeedConfig& out, OffloadDevice* written) {
  const bool optimizer = key == "offload_optimizer";
  const Section s = zero.section(key, optimizer ? kOffloadOptimizerKeys : kOffloadParamKeys);
  const std::string device =
      s.is_auto("device") ? "auto" : s.choice("device", "none", {"none", "cpu", "nvme"});
  if (device == "auto") {
    (optimizer ? out.offload_optimizer_auto : out.offload_param_auto) = true;
  }
  *written = device == "auto" ? OffloadDevice::kNone : parse_offload_device(device);
  // What the section leaves out keeps OffloadOptions' defaults (DeepSpeed's,
  // but for the NVMe pipelining, on unless pipeline_read/pipeline_write say
  // false), and offload_param's buffer_count is DeepSpeed's 5 there.
  OffloadOptions options;
  if (!optimizer) {
    options.buffer_count(kOffloadParamBufferCount);
  }
  options.nvme_path(s.string("nvme_path", options.nvme_path()));
  options.buffer_count(s.integer("buffer_count", options.buffer_count(), 0));
  options.pin_memory(s.boolean("pin_memory", pin_default));
  if (optimizer) {
    options.pipeline_read(s.boolean("pipeline_read", options.pipeline_read()));
    options.pipeline_write(s.boolean("pipeline_write", options.pipeline_write()));
    // zeroshard's own key: the gradient shard in the swap space too.
    options.swap_gradients(s.boolean("swap_gradients", options.swap_gradients()));
    for (const char* flag_key : {"fast_init", "super_offload", "convert_grad_on_cpu"}) {
      s.boolean(flag_key, false);
    }
    options.ratio(s.number("ratio", options.ratio(), 0, 1));
    s.number("cpuadam_cores_perc", 0.8, 0, 1);
  } else {
    options.buffer_size(s.integer("buffer_size", options.buffer_size(), 0));
    options.max_in_cpu(s.integer("max_in_cpu", options.max_in_cpu(), 0));
  }
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
  const Section aio = top.section("aio", kAioKeys);
  AioOptions& io = out.zero.aio();
  io.block_size(aio.integer("block_size", io.block_size(), 4096));
  io.queue_depth(aio.integer("queue_depth", io.queue_depth(), 1, 4096));
  io.intra_op_parallelism(
      aio.integer(aio.has("intra_op_parallelism") ? "intra_op_parallelism" : "thread_count",
                  io.intra_op_parallelism(), 1, 256));
  io.single_submit(aio.boolean("single_submit", io.single_submit()));
  io.overlap_events(aio.boolean("overlap_events", io.overlap_events()));
  if (aio.boolean("use_gds", false)) {
    flag(out, aio.path("use_gds"), true,
         "GPUDirect Storage is not used; ignoring it reads through host memory");
  }
  check_aio_options(io);
}

}  // namespace zeroshard::config_detail
