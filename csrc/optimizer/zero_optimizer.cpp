// ZeroOptimizer, the facade: its constructors and the public API, each a
// call into ZeroOptimizer::Impl (zero_optimizer_impl.h), where the state and
// the parts of a step live.
#include "zero_optimizer_impl.h"

#include <utility>

namespace zeroshard {

ZeroOptimizer::ZeroOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                             const torch::optim::OptimizerOptions& inner_defaults,
                             ZeroOptions options)
    : ZeroOptimizer(param_groups, std::move(process_group), inner_defaults, options, {}) {}

ZeroOptimizer::ZeroOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                             const torch::optim::OptimizerOptions& inner_defaults,
                             ZeroOptions options, std::vector<ParameterUnit> units)
    : ZeroOptimizer(param_groups, std::move(process_group), /*replicate_group=*/{}, inner_defaults,
                    options, std::move(units)) {}

ZeroOptimizer::ZeroOptimizer(std::vector<at::Tensor> params,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                             const torch::optim::OptimizerOptions& inner_defaults,
                             ZeroOptions options, std::vector<ParameterUnit> units)
    : ZeroOptimizer(
          std::vector<torch::optim::OptimizerParamGroup>{
              torch::optim::OptimizerParamGroup(std::move(params))},
          std::move(process_group), inner_defaults, options, std::move(units)) {}

ZeroOptimizer::ZeroOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                             c10::intrusive_ptr<c10d::ProcessGroup> replicate_group,
                             const torch::optim::OptimizerOptions& inner_defaults,
                             ZeroOptions options, std::vector<ParameterUnit> units)
    : Optimizer(param_groups, inner_defaults.clone()),
      impl_(std::make_unique<Impl>(*this, inner_defaults, options, std::move(process_group),
                                   std::move(replicate_group), std::move(units))) {}

ZeroOptimizer::~ZeroOptimizer() = default;

// Each public call that issues collectives names itself to the communicator:
// errors then say which call each rank is in ([Note: Which call a rank is in]
// in communicator.h).
at::Tensor ZeroOptimizer::step(LossClosure closure) {
  Communicator::CallScope call(impl_->communicator(), "step");
  return impl_->step(std::move(closure));
}
void ZeroOptimizer::zero_grad(bool set_to_none) { impl_->zero_grad(set_to_none); }
at::Tensor ZeroOptimizer::clip_grad_norm(double max_norm) {
  Communicator::CallScope call(impl_->communicator(), "clip_grad_norm");
  return impl_->clip_grad_norm(max_norm);
}
at::Tensor ZeroOptimizer::gradient_norm() {
  Communicator::CallScope call(impl_->communicator(), "gradient_norm");
  return impl_->gradient_norm();
}
void ZeroOptimizer::scale_gradients(const at::Tensor& coefficient) {
  impl_->scale_gradients(coefficient);
}
void ZeroOptimizer::set_loss_scale(double scale) { impl_->set_loss_scale(scale); }
double ZeroOptimizer::loss_scale() const { return impl_->loss_scale(); }
bool ZeroOptimizer::last_step_skipped() const { return impl_->last_step_skipped(); }
void ZeroOptimizer::skip_next_step() { impl_->skip_next_step(); }
void ZeroOptimizer::check_next_step_for_overflow() { impl_->check_next_step_for_overflow(); }
int64_t ZeroOptimizer::skipped_steps() const { return impl_->skipped_steps(); }
void ZeroOptimizer::set_gradient_sync(bool enabled) { impl_->set_gradient_sync(enabled); }
bool ZeroOptimizer::gradient_sync() const { return impl_->gradient_sync(); }
int64_t ZeroOptimizer::gradient_bytes() const { return impl_->gradient_bytes(); }
int64_t ZeroOptimizer::host_gradient_bytes() const { return impl_->host_gradient_bytes(); }
int64_t ZeroOptimizer::peak_staging_bytes() const { return impl_->peak_staging_bytes(); }
void ZeroOptimizer::reset_peak_staging_bytes() { impl_->reset_peak_staging_bytes(); }
int64_t ZeroOptimizer::cached_buffer_bytes() const { return impl_->cached_buffer_bytes(); }
int64_t ZeroOptimizer::release_cached_buffers() { return impl_->release_cached_buffers(); }
InnerOptimizerKind ZeroOptimizer::inner_kind() const { return impl_->inner_kind(); }
const ZeroOptions& ZeroOptimizer::zero_options() const { return impl_->zero_options(); }
const PartitionLayout& ZeroOptimizer::layout() const { return impl_->layout(); }
Communicator& ZeroOptimizer::communicator() { return impl_->communicator(); }
Communicator* ZeroOptimizer::replica_communicator() { return impl_->replica_communicator(); }
int64_t ZeroOptimizer::data_parallel_world_size() const {
  return impl_->data_parallel_world_size();
}
void ZeroOptimizer::set_tensor_parallel(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                        std::vector<std::vector<bool>> sharded,
                                        std::vector<std::vector<TensorParallelSplit>> splits) {
  impl_->set_tensor_parallel(std::move(group), std::move(sharded), std::move(splits));
}
int64_t ZeroOptimizer::checkpoint_rank() const { return impl_->checkpoint_rank(); }
void ZeroOptimizer::set_expert_parallel(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  impl_->set_expert_parallel(std::move(group));
}
ZeroOptimizer::ModelParallel ZeroOptimizer::model_parallel() const {
  return impl_->model_parallel();
}
void ZeroOptimizer::gradient_arrived(size_t group, int64_t index) {
  impl_->gradient_arrived(group, index);
}
const at::Tensor& ZeroOptimizer::flat_parameters(size_t group) const {
  return impl_->flat_parameters(group);
}
int64_t ZeroOptimizer::optimizer_state_bytes() const { return impl_->optimizer_state_bytes(); }
int64_t ZeroOptimizer::device_model_state_bytes() const {
  return impl_->device_model_state_bytes();
}
int64_t ZeroOptimizer::host_model_state_bytes() const { return impl_->host_model_state_bytes(); }
const StatePlacement& ZeroOptimizer::placement() const { return impl_->placement(); }
const NvmeStateSwapper* ZeroOptimizer::nvme_swapper() const { return impl_->nvme_swapper(); }
const NvmeGradientSwapper* ZeroOptimizer::gradient_swapper() const {
  return impl_->gradient_swapper();
}
const NvmeParameterSwapper* ZeroOptimizer::parameter_swapper() const {
  return impl_->parameter_swapper();
}
ShardState ZeroOptimizer::shard_state() const { return impl_->shard_state(); }
void ZeroOptimizer::load_shard_state(const ShardState& state) { impl_->load_shard_state(state); }
ZeroOptimizer::ParameterStatePart ZeroOptimizer::parameter_state(size_t group, int64_t index,
                                                                 bool read_states) const {
  return impl_->parameter_state(group, index, read_states);
}
void ZeroOptimizer::write_parameter_state(size_t group, int64_t index, const std::string& name,
                                          const at::Tensor& values) {
  impl_->write_parameter_state(group, index, name, values);
}
void ZeroOptimizer::set_parameter_names(
    const std::vector<std::pair<std::string, at::Tensor>>& named) {
  impl_->set_parameter_names(named);
}
std::string ZeroOptimizer::parameter_name(size_t group, size_t index) const {
  return impl_->parameter_name(group, index);
}
std::vector<std::string> ZeroOptimizer::parameter_aliases(size_t group, size_t index) const {
  return impl_->parameter_aliases(group, index);
}
void ZeroOptimizer::save_checkpoint(const std::string& path, const CheckpointSaveOptions& options) {
  Communicator::CallScope call(impl_->communicator(), "save_checkpoint");
  impl_->save_checkpoint(path, options);
}
LoadedCheckpoint ZeroOptimizer::load_checkpoint(const std::string& path,
                                                const CheckpointLoadOptions& options) {
  Communicator::CallScope call(impl_->communicator(), "load_checkpoint");
  return impl_->load_checkpoint(path, options);
}
void ZeroOptimizer::wait_for_checkpoint() { impl_->wait_for_checkpoint(); }
bool ZeroOptimizer::checkpoint_in_flight() const { return impl_->checkpoint_in_flight(); }
void ZeroOptimizer::set_checkpoint_store(c10::intrusive_ptr<c10d::Store> store,
                                         std::string prefix) {
  impl_->set_checkpoint_store(std::move(store), std::move(prefix));
}
void ZeroOptimizer::save(torch::serialize::OutputArchive& archive) const { impl_->save(archive); }
void ZeroOptimizer::load(torch::serialize::InputArchive& archive) { impl_->load(archive); }
std::vector<std::vector<at::Tensor>> ZeroOptimizer::full_parameters(int64_t rank) {
  Communicator::CallScope call(impl_->communicator(), "full_parameters");
  return impl_->full_parameters(rank);
}
int64_t ZeroOptimizer::num_units() const { return impl_->num_units(); }
int64_t ZeroOptimizer::unit_index(const std::string& name) const { return impl_->unit_index(name); }
void ZeroOptimizer::unit_pre_forward(int64_t unit) {
  Communicator::CallScope call(impl_->communicator(), "forward");
  impl_->unit_pre_forward(unit);
}
void ZeroOptimizer::unit_post_forward(int64_t unit) { impl_->unit_post_forward(unit); }
void ZeroOptimizer::unit_track_output(int64_t unit, const at::Tensor& output) {
  impl_->unit_track_output(unit, output);
}
void ZeroOptimizer::model_forward_begin() { impl_->model_forward_begin(); }
void ZeroOptimizer::model_forward_end(bool raised) { impl_->model_forward_end(raised); }
int64_t ZeroOptimizer::agreements() const { return impl_->agreements(); }
int64_t ZeroOptimizer::diverged_agreements() const { return impl_->diverged_agreements(); }
std::map<std::string, int64_t> ZeroOptimizer::host_sync_counts() const {
  return impl_->host_syncs_.counts();
}
HostSyncCounter& ZeroOptimizer::host_sync_counter() { return impl_->host_syncs_; }
void ZeroOptimizer::set_host_channel(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  if (group) {
    impl_->communicator().set_host_channel(std::move(group));
  } else {
    impl_->communicator().clear_host_channel();
  }
}
void ZeroOptimizer::pin_parameters(const std::vector<at::Tensor>& params) {
  Communicator::CallScope call(impl_->communicator(), "gathered_parameters");
  impl_->pin_parameters(params);
}
void ZeroOptimizer::unpin_parameters(const std::vector<at::Tensor>& params, int64_t modifier_rank) {
  Communicator::CallScope call(impl_->communicator(), "gathered_parameters");
  impl_->unpin_parameters(params, modifier_rank);
}
void ZeroOptimizer::broadcast_buffers(const std::vector<at::Tensor>& buffers) {
  Communicator::CallScope call(impl_->communicator(), "broadcast_buffers");
  impl_->broadcast_buffers(buffers);
}
const std::vector<std::vector<at::Tensor>>& ZeroOptimizer::replacement_parameters() const {
  return impl_->replacement_parameters();
}
void ZeroOptimizer::adopt_parameters(const std::vector<std::vector<at::Tensor>>& params) {
  impl_->adopt_parameters(params);
}
void ZeroOptimizer::begin_initialization(const std::vector<at::Tensor>& params) {
  impl_->begin_initialization(params);
}
void ZeroOptimizer::end_initialization(const std::vector<at::Tensor>& params) {
  impl_->end_initialization(params);
}
void ZeroOptimizer::finish_initialization(const std::string& local_error) {
  impl_->finish_initialization(local_error);
}
int64_t ZeroOptimizer::parameter_bytes() const { return impl_->parameter_bytes(); }
int64_t ZeroOptimizer::gathered_parameter_bytes() const {
  return impl_->gathered_parameter_bytes();
}
int64_t ZeroOptimizer::peak_gathered_parameter_bytes() const {
  return impl_->peak_gathered_parameter_bytes();
}
void ZeroOptimizer::reset_peak_gathered_parameter_bytes() {
  impl_->reset_peak_gathered_parameter_bytes();
}

}  // namespace zeroshard
