// The training device's tier of ShardStorage: each group's states are
// tensors of its GroupBuffers. Internal to csrc/optimizer/.
#pragma once

#include "zeroshard/inner_optimizer.h"
#include "zeroshard/partition_layout.h"
#include "zeroshard/shard_storage.h"
#include "zeroshard/update_rule.h"

#include "group_buffers.h"
#include "parameter_states.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zeroshard {

class DeviceShardStorage final : public ShardStorage {
 public:
  // `buffers` and `layout` are the optimizer's and outlive this;
  // `param_shapes`: each group's parameters' shapes (an UpdateRule's pieces
  // carry them).
  DeviceShardStorage(std::vector<GroupBuffers>& buffers, const PartitionLayout& layout,
                     int64_t rank, c10::Device device, InnerOptimizerKind kind,
                     std::vector<std::vector<std::vector<int64_t>>> param_shapes);

  // This rank's fp32 master values of one bucket, as a view updated in place
  // (the update writes through it): the group's master tensor, or with fp32
  // parameters their own values ([Note: fp32 master] in
  // zero_optimizer_master.cpp).
  at::Tensor master_view(size_t group, const Bucket& bucket) const;

  void ensure_states(size_t group, const std::vector<OptimizerStateName>& names) override;
  bool has(size_t group, OptimizerStateName name) const override;
  at::Tensor read(size_t group, OptimizerStateName name, int64_t offset, int64_t length,
                  const at::TensorOptions& options) const override;
  at::Tensor view(size_t group, OptimizerStateName name, int64_t offset,
                  int64_t length) const override;
  void write(size_t group, OptimizerStateName name, int64_t offset,
             const at::Tensor& values) override;
  void adopt(size_t group, OptimizerStateName name, const at::Tensor& values) override;
  int64_t bytes(StateTier tier) const override;
  c10::Device home_device() const override { return device_; }
  void update(size_t group, const torch::optim::OptimizerOptions& options,
              const std::vector<UpdateRun>& runs, const at::Tensor& grad_shard, double grad_scale,
              bool fused, const UpdateCallbacks& callbacks) override;
  // The pieces of parameters `runs` cover, from the group's segments (the
  // padding between them is left alone): what an UpdateRule updates, on
  // this tier and on the offloaded one.
  std::vector<RulePiece> rule_pieces(size_t group, const std::vector<UpdateRun>& runs) const;
  // Where the pieces' parameter states are (the optimizer's; outlives this).
  void set_parameter_states(const ParameterStates* states) { parameter_states_ = states; }

 private:
  // An UpdateRule's step: the runs' parameter pieces, each with its states.
  void update_by_rule(size_t group, const RuleOptions& options, const std::vector<UpdateRun>& runs,
                      const at::Tensor& grad_shard);

  std::vector<GroupBuffers>& buffers_;
  const PartitionLayout& layout_;
  int64_t rank_;
  c10::Device device_;
  InnerOptimizerKind kind_;
  std::vector<std::vector<std::vector<int64_t>>> param_shapes_;
  const ParameterStates* parameter_states_ = nullptr;
};

}  // namespace zeroshard
