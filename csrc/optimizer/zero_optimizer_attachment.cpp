// ZeroOptimizer: whether the model's parameters still use the optimizer's
// storage, checked at every step.
//
// [Note: parameters that left the optimizer's storage]
// At construction every parameter becomes a view of storage the optimizer
// owns (stages 1-2: the group's flat buffer; stage 3: its bucket's gathered
// buffer), so the all-gather after each step writes the model directly.
// torch.optim holds the Parameter objects instead, and keeps working after
// anything that gives a parameter new storage: model.to("cpu:0") (a copy,
// since "cpu:0" is not "cpu"), model.cuda(), p.data = tensor. Here such a
// parameter would silently stop training: the update lands in the
// optimizer's buffer, the model keeps reading its copy.
//
// So every step compares each parameter with the view it must be. A copy
// with the same device, dtype, shape and values (a move that changed
// nothing) is re-attached: it becomes the view again, as if it had never
// left. Anything else (another device or dtype, other values, a released
// stage-3 bucket that cannot be compared) is an error raised on every rank:
// the ranks agree on it in the step's flag all-reduce, which costs nothing
// extra on the common path, and only a failure gathers the names.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/equal.h>

#include <sstream>

#include "zero_optimizer_impl.h"
#include "zeroshard/parameter_gatherer.h"

namespace zeroshard {
namespace {

bool same_device(const c10::Device& a, const c10::Device& b) {
  // A CPU tensor's device has no index; "cpu" and "cpu:0" are one device.
  return a.type() == b.type() && (a.is_cpu() || a.index() == b.index());
}

}  // namespace

// The buffer parameter (g, i) must be a view of, and where in its storage.
// (No view is made here: narrowing a released stage-3 buffer, whose storage
// holds 0 bytes, would fail its bounds check.)
std::pair<const at::Tensor*, int64_t> ZeroOptimizer::Impl::attached_place(size_t g,
                                                                          size_t i) const {
  const GroupLayout& layout = layout_->group(g);
  const ParamSlot& slot = layout.slot_of_param(static_cast<int64_t>(i));
  if (options_.stage() == 3) {
    const Bucket& bucket = layout.buckets()[slot.bucket_index];
    const at::Tensor& full = gatherer_->full(g, slot.bucket_index);
    return {&full, full.storage_offset() + slot.flat_offset - bucket.flat_offset};
  }
  const at::Tensor& flat = buffers_[g].flat_param;
  return {&flat, flat.storage_offset() + slot.flat_offset};
}

std::string ZeroOptimizer::Impl::reattach_parameters() {
  at::NoGradGuard no_grad;
  std::vector<std::string> problems;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    bool awaiting_adoption = false;  // a meta model before adopt_parameters
    for (const auto& replacement : replacements_[g]) {
      awaiting_adoption = awaiting_adoption || replacement.defined();
    }
    if (awaiting_adoption || (options_.stage() < 3 && !buffers_[g].flat_param.defined())) {
      continue;
    }
    auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& param = params[i];
      if (param.numel() == 0) {  // in no bucket: nothing to update
        continue;
      }
      const auto [buffer, offset] = attached_place(g, i);
      const ParamSlot& slot = layout_->group(g).slot_of_param(static_cast<int64_t>(i));
      const int64_t numel = slot.numel;
      if (param.has_storage() &&
          param.storage().unsafeGetStorageImpl() == buffer->storage().unsafeGetStorageImpl() &&
          param.storage_offset() == offset && param.numel() == numel && param.is_contiguous()) {
        continue;
      }
      std::ostringstream why;
      why << "'" << parameter_name(g, i) << "' ";
      if (param.numel() != numel) {
        why << "has " << param.numel() << " elements instead of " << numel;
      } else if (!same_device(param.device(), buffer->device())) {
        why << "was moved to " << param.device() << " (the optimizer holds it on "
            << buffer->device() << ")";
      } else if (param.scalar_type() != buffer->scalar_type()) {
        why << "was converted to " << param.scalar_type() << " (the optimizer holds it in "
            << buffer->scalar_type() << ")";
      } else if (options_.stage() == 3 && !gatherer_->materialized(g, slot.bucket_index)) {
        why << "was given new storage while its stage-3 shard was released";
      } else {
        const at::Tensor view =
            buffer->narrow(0, offset - buffer->storage_offset(), numel).view(param.sizes());
        if (!at::equal(param, view)) {
          why << "was given other values through new storage (p.data = ..., or a load that "
                 "replaced the tensor)";
        } else {
          param.set_data(view);  // a copy that changed nothing: follow it
          continue;
        }
      }
      problems.push_back(why.str());
    }
  }
  if (problems.empty()) {
    return "";
  }
  std::ostringstream message;
  message << problems.size()
          << " parameter(s) no longer use the optimizer's storage, so step() cannot update them: ";
  for (size_t k = 0; k < problems.size() && k < 3; ++k) {
    message << (k ? "; " : "") << problems[k];
  }
  if (problems.size() > 3) {
    message << "; and " << problems.size() - 3 << " more";
  }
  message
      << ". Move or convert the model before building the ZeroOptimizer "
         "(model.to(device, dtype), then ZeroOptimizer(model.parameters(), ...)); change "
         "values in place (p.copy_(...)) inside optimizer.gathered_parameters(modifier_rank=0), "
         "or load them with load_checkpoint()";
  return message.str();
}

}  // namespace zeroshard
