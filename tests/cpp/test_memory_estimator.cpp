#include "zeroshard/memory_estimator.h"
#include "zeroshard/shard_chunk.h"
#include "zeroshard/traffic_estimator.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>

namespace zeroshard {
namespace {

double ModelStates(const MemoryEstimate& e) {
  return e.param_bytes + e.grad_bytes + e.optimizer_bytes;
}

TEST(MemoryEstimatorTest, ReproducesTheZeroPaperFigures) {
  // ZeRO paper, Figure 1: 7.5B parameters, 64 ranks, mixed-precision Adam.
  auto options = EstimateOptions().num_params(7.5e9).world_size(64);
  EXPECT_NEAR(ModelStates(estimate_memory(0, options)) / 1e9, 120.0, 0.05);
  EXPECT_NEAR(ModelStates(estimate_memory(1, options)) / 1e9, 31.4, 0.05);
  EXPECT_NEAR(ModelStates(estimate_memory(2, options)) / 1e9, 16.6, 0.05);
  EXPECT_NEAR(ModelStates(estimate_memory(3, options)) / 1e9, 1.875, 0.001);
}

TEST(MemoryEstimatorTest, TensorAndPipelineParallelDegreesSplitTheModelBeforeZero) {
  // The seeds' 3D example: 175B parameters on 64 ranks, TP 8 inside a node,
  // PP 4, so DP 2: each rank holds 175e9 / 32 parameters, ZeRO halves that.
  const double slice = 175e9 / 32;
  auto options = EstimateOptions()
                     .num_params(175e9)
                     .largest_unit_params(1.2e9)
                     .world_size(64)
                     .tensor_parallel_size(8)
                     .pipeline_parallel_size(4);
  EXPECT_DOUBLE_EQ(ModelStates(estimate_memory(1, options)),
                   2 * slice + 2 * slice + 12 * slice / 2);
  EXPECT_DOUBLE_EQ(ModelStates(estimate_memory(3, options)), 16 * slice / 2);
  // A unit is split TP ways: 1.2e9 / 8 parameters gathered (none prefetched:
  // a unit is larger than the 5e7-element window), and its gradient is a
  // bucket of its own.
  EXPECT_DOUBLE_EQ(estimate_memory(3, options).working_bytes, 2 * 1.2e9 / 8);
  EXPECT_DOUBLE_EQ(estimate_memory(3, options).staging_bytes,
                   2 * (3 * 1.2e9 / 8 + 2 * 1.2e9 / 8 / 2));
  // The same as ZeRO over the DP ranks alone on the rank's slice of the model.
  auto slice_only =
      EstimateOptions().num_params(slice).largest_unit_params(1.2e9 / 8).world_size(2);
  EXPECT_DOUBLE_EQ(estimate_memory(2, options).device_bytes,
                   estimate_memory(2, slice_only).device_bytes);
  try {
    estimate_memory(1, EstimateOptions().num_params(1e9).world_size(12).tensor_parallel_size(8));
    ADD_FAILURE() << "world_size 12 with TP 8 should be refused";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("world_size 12 must be a multiple of "
                                         "tensor_parallel_size x pipeline_parallel_size = 8"),
              std::string::npos)
        << e.what();
  }
}

TEST(MemoryEstimatorTest, ActivationsFollowKorthikantiAndCountOnTheDevice) {
  // GPT-3 175B's shape (h 12288, a 96, s 2048, 96 layers), micro-batch 1,
  // TP 8: eq. 2 of Korthikanti et al. gives s*b*h*(10 + 24/t + 5*a*s/(h*t))
  // bytes per layer in 16 bits.
  auto shape = TransformerShape()
                   .layers(96)
                   .hidden(12288)
                   .heads(96)
                   .sequence_length(2048)
                   .micro_batch(1)
                   .tensor_parallel_size(8);
  const double sbh = 2048.0 * 12288;
  const double per_layer = sbh * (10 + 24.0 / 8 + 5.0 * 96 * 2048 / (12288 * 8));
  EXPECT_DOUBLE_EQ(estimate_activation_bytes(shape), 96 * per_layer);  // vocab 0: no logits
  // fp32 doubles everything but the 1-byte dropout masks.
  const double masks = sbh * 2 + 96.0 * 2048 * 2048 / 8;
  EXPECT_DOUBLE_EQ(estimate_activation_bytes(shape.bytes_per_value(4)),
                   96 * (2 * (per_layer - masks) + masks));
  auto options = EstimateOptions().num_params(1e9).world_size(8);
  const double without = estimate_memory(2, options).device_bytes;
  const double with = estimate_memory(2, options.activation_bytes(3e9)).device_bytes;
  EXPECT_DOUBLE_EQ(with - without, 3e9);
}

TEST(MemoryEstimatorTest, CountsTheGradientBucketsAndTheGatheredUnits) {
  // 1e9 parameters on 4 ranks, bf16: what ZeroOptimizer's buffers hold at
  // once (gradient_buckets.h, parameter_gatherer.h).
  auto options = EstimateOptions().num_params(1e9).world_size(4);
  // Below stage 3 a bucket is reduce_bucket_size: max_buckets_in_flight (2)
  // reducing, one filling, and the reduced shards of those in flight.
  const double bucket = 5e6;
  EXPECT_DOUBLE_EQ(estimate_memory(2, options).staging_bytes, 2 * (3 * bucket + 2 * bucket / 4));
  EXPECT_DOUBLE_EQ(estimate_memory(1, options).staging_bytes,
                   estimate_memory(2, options).staging_bytes);
  EXPECT_EQ(estimate_memory(0, options).staging_bytes, 0);
  EXPECT_EQ(estimate_memory(2, options).working_bytes, 0);
  // On a CPU device the all-to-all reduce-scatter receives a bucket per
  // collective in flight.
  EXPECT_DOUBLE_EQ(estimate_memory(2, EstimateOptions(options).host_device(true)).staging_bytes,
                   2 * (3 * bucket + 2 * bucket / 4 + 2 * bucket));
  // Stage 3 with 2e7-parameter units: a unit is a bucket, and two more units
  // fit in the 5e7 prefetch window.
  auto units = EstimateOptions(options).largest_unit_params(2e7);
  const MemoryEstimate three = estimate_memory(3, units);
  EXPECT_DOUBLE_EQ(three.working_bytes, 2 * 3 * 2e7);
  EXPECT_DOUBLE_EQ(three.staging_bytes, 2 * (3 * 2e7 + 2 * 2e7 / 4));
  EXPECT_DOUBLE_EQ(three.device_bytes, ModelStates(three) + three.working_bytes +
                                           three.staging_bytes + three.step_bytes);
  // More buckets in flight, a smaller window: both follow.
  const MemoryEstimate tuned =
      estimate_memory(3, EstimateOptions(units).max_buckets_in_flight(4).prefetch_bucket_size(0));
  EXPECT_DOUBLE_EQ(tuned.working_bytes, 2 * 2e7);
  EXPECT_DOUBLE_EQ(tuned.staging_bytes, 2 * (5 * 2e7 + 4 * 2e7 / 4));
  EXPECT_THROW(estimate_memory(2, EstimateOptions(options).max_buckets_in_flight(0)),
               c10::ValueError);
}

TEST(MemoryEstimatorTest, FollowsMaxLiveParametersAndFp32Reduction) {
  auto units = EstimateOptions().num_params(1e9).world_size(4).largest_unit_params(2e7);
  // The 5e7 window holds two more 2e7 units; a 5e7 live cap leaves room for
  // one beside the unit in use, a cap below a unit for none.
  EXPECT_DOUBLE_EQ(estimate_memory(3, units).working_bytes, 2 * 3 * 2e7);
  EXPECT_DOUBLE_EQ(
      estimate_memory(3, EstimateOptions(units).max_live_parameters(5e7)).working_bytes,
      2 * 2 * 2e7);
  EXPECT_DOUBLE_EQ(
      estimate_memory(3, EstimateOptions(units).max_live_parameters(1e7)).working_bytes, 2 * 2e7);
  EXPECT_THROW(estimate_memory(3, EstimateOptions(units).max_live_parameters(-1)), c10::ValueError);
  // Gradients reduced in fp32: the buckets and the shard are 4 bytes an
  // element; autograd's stage-1 gradients stay bf16.
  const auto fp32_reduction = EstimateOptions(units).reduce_in_fp32(true);
  const MemoryEstimate three = estimate_memory(3, fp32_reduction);
  EXPECT_DOUBLE_EQ(three.grad_bytes, 4 * 1e9 / 4);
  EXPECT_DOUBLE_EQ(three.staging_bytes, 4 * (3 * 2e7 + 2 * 2e7 / 4));
  const MemoryEstimate one = estimate_memory(1, fp32_reduction);
  EXPECT_DOUBLE_EQ(one.grad_bytes, 2 * 1e9);
  EXPECT_DOUBLE_EQ(one.staging_bytes, 4 * (3 * 5e6 + 2 * 5e6 / 4));
  // fp32 parameters are reduced in fp32 anyway.
  const auto fp32 = EstimateOptions(units).precision(PrecisionRecipe::kFp32);
  EXPECT_DOUBLE_EQ(estimate_memory(3, EstimateOptions(fp32).reduce_in_fp32(true)).device_bytes,
                   estimate_memory(3, fp32).device_bytes);
}

TEST(MemoryEstimatorTest, Fp32AndSgdStateSizes) {
  auto fp32 = state_bytes_per_param(PrecisionRecipe::kFp32, StateKind::kAdam);
  EXPECT_EQ(fp32.param, 4);
  EXPECT_EQ(fp32.grad, 4);
  EXPECT_EQ(fp32.optimizer, 8);
  EXPECT_EQ(state_bytes_per_param(PrecisionRecipe::kMixed16, StateKind::kAdam).optimizer, 12);
  EXPECT_EQ(state_bytes_per_param(PrecisionRecipe::kMixed16, StateKind::kSgdMomentum).optimizer, 8);
  EXPECT_EQ(state_bytes_per_param(PrecisionRecipe::kFp32, StateKind::kSgd).optimizer, 0);
}

// amsgrad's max_exp_avg_sq is a third fp32 state: the estimator counted two
// before it took the count from inner_optimizer_states.
TEST(MemoryEstimatorTest, AmsgradCountsItsThirdState) {
  EXPECT_EQ(state_count(StateKind::kAdamAmsgrad), 3);
  EXPECT_EQ(state_count(parse_state_kind("adamw_amsgrad")), 3);
  EXPECT_EQ(state_bytes_per_param(PrecisionRecipe::kMixed16, StateKind::kAdamAmsgrad).optimizer,
            16);
  EXPECT_EQ(state_bytes_per_param(PrecisionRecipe::kFp32, StateKind::kAdamAmsgrad).optimizer, 12);
  const auto adam = EstimateOptions().num_params(1e6).world_size(2);
  EXPECT_GT(
      estimate_memory(1, EstimateOptions(adam).optimizer(StateKind::kAdamAmsgrad)).optimizer_bytes,
      estimate_memory(1, adam).optimizer_bytes);
}

TEST(MemoryEstimatorTest, OffloadMovesBytesToTheNode) {
  auto options =
      EstimateOptions().num_params(1e9).world_size(8).ranks_per_node(8).offload_optimizer(
          OffloadDevice::kCPU);
  auto e = estimate_memory(2, options);
  EXPECT_EQ(e.optimizer_bytes, 0);
  // Every sub-group offloaded: the gradient shard is on the host, in fp32.
  EXPECT_EQ(e.grad_bytes, 0);
  // Per rank: 12 bytes x 1e9 / 8 of state, the fp32 gradient shard (4 bytes)
  // and one staging slot of the whole shard (a single sub-group) for the
  // bf16 parameter copy (2 bytes); on an accelerator also the pinned staging
  // of the reduced slices in flight (2 of 5e6 / 8 bf16 elements per rank).
  const double pinned = 2 * 5e6 / 8 * 2 * 8;
  EXPECT_DOUBLE_EQ(e.cpu_bytes_per_node, 12e9 + 6e9 + pinned);
  EXPECT_DOUBLE_EQ(
      estimate_memory(2, EstimateOptions(options).host_device(true)).cpu_bytes_per_node,
      12e9 + 6e9);
  // Ten sub-groups of 1.25e7: two staging slots (fp32 gradient and bf16
  // copy); ratio 0.5 keeps five on the device, and the gradient shard there.
  auto partial =
      estimate_memory(2, EstimateOptions(options).sub_group_size(1.25e7).offload_ratio(0.5));
  EXPECT_DOUBLE_EQ(partial.grad_bytes, 2 * 1.25e8);
  EXPECT_DOUBLE_EQ(partial.optimizer_bytes, 12 * 1.25e8 / 2);
  EXPECT_DOUBLE_EQ(partial.cpu_bytes_per_node, (12 * 1.25e8 / 2 + 2 * 1.25e7 * 6) * 8);
  // fp32 parameters: the offloaded master is a copy of its own (12 bytes, not
  // 8); the fp32 gradient shard and the fp32 parameter copy, 4 bytes each.
  auto fp32 = estimate_memory(2, EstimateOptions(options).precision(PrecisionRecipe::kFp32));
  EXPECT_DOUBLE_EQ(fp32.cpu_bytes_per_node, (12 * 1.25e8 + 8 * 1.25e8) * 8 + 2 * pinned);
  const auto nvme_options = EstimateOptions(options)
                                .offload_optimizer(OffloadDevice::kNVMe)
                                .offload_param(OffloadDevice::kNVMe)
                                .largest_unit_params(1e7);
  const auto states_only =
      estimate_memory(3, EstimateOptions(nvme_options).offload_param(OffloadDevice::kNone));
  auto nvme = estimate_memory(3, EstimateOptions(nvme_options).param_max_in_cpu(0));
  EXPECT_DOUBLE_EQ(nvme.nvme_bytes_per_node, 14e9);
  // With NVMe the host gradient shard stays bf16 (2 bytes x 1.25e8 per rank)
  // and is staged in fp32 for the step, beside the bf16 parameter copy; the
  // pinned slices in flight are a unit's (1e7 / 8 elements) at stage 3.
  EXPECT_EQ(states_only.grad_bytes, 0);
  EXPECT_DOUBLE_EQ(states_only.cpu_bytes_per_node,
                   (12 * 1.25e8 + 2 * 1.25e8 + 1.25e8 * (4 + 2) + 2 * 1e7 / 8 * 2) * 8);
  // The gathered units (the largest and the five that fit in the prefetch
  // window) and the gradient buckets (3 of a unit each, two reduced shards);
  // the gradient shard is on the host.
  EXPECT_DOUBLE_EQ(nvme.device_bytes, 2 * 6e7 + 2 * (3e7 + 2 * 1e7 / 8));
  // In host memory besides the optimizer tier's buffers: five buckets read
  // ahead, each the largest unit's shard (1e7 / 8 bf16 elements), per rank.
  EXPECT_DOUBLE_EQ(nvme.cpu_bytes_per_node - states_only.cpu_bytes_per_node, 5 * 1.25e6 * 2 * 8);
  // DeepSpeed's default max_in_cpu (1e9 elements) keeps these shards (1.25e8
  // elements) in host memory: nothing to read ahead.
  auto in_cpu = estimate_memory(3, nvme_options);
  EXPECT_DOUBLE_EQ(in_cpu.nvme_bytes_per_node, 12e9);
  EXPECT_DOUBLE_EQ(in_cpu.cpu_bytes_per_node - states_only.cpu_bytes_per_node, 2e9);
  // swap_gradients: the bf16 host shard (2 bytes x 1.25e8 per rank) leaves
  // RAM for the disk in fp32 (4 bytes); buffer_count (4) blocks of 2^20 fp32
  // elements stay, and each staging slot gains its 2 x 1024-element margin;
  // no pinned slices (the swap copies each reduced slice to the host itself).
  const auto swapped =
      estimate_memory(3, EstimateOptions(nvme_options).param_max_in_cpu(0).swap_gradients(true));
  EXPECT_DOUBLE_EQ(swapped.nvme_bytes_per_node, 14e9 + 4e9);
  EXPECT_DOUBLE_EQ(swapped.cpu_bytes_per_node - nvme.cpu_bytes_per_node,
                   (-2 * 1.25e8 - 2 * 1e7 / 8 * 2 + 4 * 4 * 1048576.0 + 2048 * 4) * 8);
  EXPECT_EQ(swapped.device_bytes, nvme.device_bytes);
  // Where ZeroOptimizer would not swap (stage 1, CPU offload) it changes nothing.
  EXPECT_DOUBLE_EQ(
      estimate_memory(
          1, EstimateOptions(nvme_options).offload_param(OffloadDevice::kNone).swap_gradients(true))
          .cpu_bytes_per_node,
      estimate_memory(1, EstimateOptions(nvme_options).offload_param(OffloadDevice::kNone))
          .cpu_bytes_per_node);
  EXPECT_DOUBLE_EQ(
      estimate_memory(2, EstimateOptions(options).swap_gradients(true)).cpu_bytes_per_node,
      e.cpu_bytes_per_node);
  EXPECT_THROW(estimate_memory(2, EstimateOptions(options).offload_param(OffloadDevice::kCPU)),
               c10::ValueError);
}

TEST(MemoryEstimatorTest, TheStepWidensOneChunkOfA16BitGradientAtATime) {
  // 1e9 mixed-precision parameters over 8 ranks: a 1.25e8-element shard,
  // widened to fp32 4M elements at a time (16 MiB), whatever the stage.
  const auto options = EstimateOptions().num_params(1e9).world_size(8);
  for (int64_t stage : {1, 2, 3}) {
    EXPECT_DOUBLE_EQ(estimate_memory(stage, options).step_bytes, 4.0 * kShardChunkElements);
  }
  EXPECT_EQ(estimate_memory(0, options).step_bytes, 0);
  // A shard smaller than a chunk is widened whole.
  EXPECT_DOUBLE_EQ(estimate_memory(2, EstimateOptions(options).num_params(1e6)).step_bytes,
                   4 * 1e6 / 8);
  // fp32 gradients (fp32 training, or reduced in fp32) are updated as they are.
  EXPECT_EQ(
      estimate_memory(2, EstimateOptions(options).precision(PrecisionRecipe::kFp32)).step_bytes, 0);
  EXPECT_EQ(estimate_memory(2, EstimateOptions(options).reduce_in_fp32(true)).step_bytes, 0);
  // Every sub-group offloaded: the host kernel reads the gradient in place.
  const auto cpu = EstimateOptions(options).offload_optimizer(OffloadDevice::kCPU);
  EXPECT_EQ(estimate_memory(2, cpu).step_bytes, 0);
  // Half of ten 1.25e7-element sub-groups on the device: one sub-group's
  // gradient widened (4 bytes) and scaled (4 more); fp32 gradients are only
  // scaled.
  const auto partial = EstimateOptions(cpu).sub_group_size(1.25e7).offload_ratio(0.5);
  EXPECT_DOUBLE_EQ(estimate_memory(2, partial).step_bytes, 8 * 1.25e7);
  EXPECT_DOUBLE_EQ(
      estimate_memory(2, EstimateOptions(partial).precision(PrecisionRecipe::kFp32)).step_bytes,
      4 * 1.25e7);
}

TEST(MemoryEstimatorTest, ReproducesDeepSpeedFormulas) {
  const double p = 1e9, l = 5e7, n = 16, g = 8;
  auto options =
      EstimateOptions().num_params(p).largest_unit_params(l).world_size(16).ranks_per_node(8);
  EXPECT_DOUBLE_EQ(deepspeed_estimate(2, options).device_bytes, 2 * p + 18 * p / n);
  EXPECT_DOUBLE_EQ(deepspeed_estimate(2, options).cpu_bytes, 4 * p * g * 1.5);
  auto offload = EstimateOptions(options).offload_optimizer(OffloadDevice::kCPU);
  EXPECT_DOUBLE_EQ(deepspeed_estimate(2, offload).device_bytes, 2 * p);
  EXPECT_DOUBLE_EQ(deepspeed_estimate(2, offload).cpu_bytes, p * 4 * n * 1.5);
  EXPECT_DOUBLE_EQ(deepspeed_estimate(3, options).device_bytes, 4 * l + 18 * p / n);
  EXPECT_DOUBLE_EQ(deepspeed_estimate(3, offload).device_bytes, 4 * l + 2 * p / n);
  EXPECT_DOUBLE_EQ(
      deepspeed_estimate(3, EstimateOptions(offload).offload_param(OffloadDevice::kCPU))
          .device_bytes,
      4 * l);
}

TEST(MemoryEstimatorTest, RecommendsStageTwoBeforeThreeAndOffloadLast) {
  // 13B on 8 ranks with 60 GB each: stage 1 needs 71.5 GB, stage 2 48.8 GB.
  auto options = EstimateOptions().num_params(13e9).world_size(8).ranks_per_node(8);
  auto r = recommend_configuration(options, 60e9);
  ASSERT_TRUE(r.fits);
  EXPECT_EQ(r.estimate.stage, 2);
  EXPECT_EQ(r.offload_optimizer, OffloadDevice::kNone);
  EXPECT_NE(r.reason.find("ZeRO stage 1 would need"), std::string::npos) << r.reason;
  // Far too small a device: offload is the last resort. (Stage 3 with both
  // offloaded keeps the 3.25 GB gradient shard, a 1e8-parameter unit
  // gathered and three of it in the gradient buckets: 4.1 GB.)
  auto tiny = recommend_configuration(options.largest_unit_params(1e8), 5e9);
  ASSERT_TRUE(tiny.fits) << tiny.reason;
  EXPECT_EQ(tiny.estimate.stage, 3);
  EXPECT_NE(tiny.offload_optimizer, OffloadDevice::kNone);
  auto none = recommend_configuration(options, 1e6);
  EXPECT_FALSE(none.fits);
  EXPECT_NE(none.reason.find("nothing fits"), std::string::npos);
}

TEST(TrafficEstimatorTest, ZeroPaperVolumesOverTheDataParallelRanks) {
  // ZeRO paper, section 7: stages 1 and 2 move what DDP's all-reduce moves
  // (2Ψ per rank, ring), stage 3 1.5 times that.
  auto options = EstimateOptions().num_params(7.5e9).world_size(64);
  const double ddp = estimate_traffic(0, options).data_parallel_bytes;
  EXPECT_NEAR(ddp, 2 * 63.0 / 64 * 7.5e9 * 2, 1e3);
  EXPECT_DOUBLE_EQ(estimate_traffic(1, options).data_parallel_bytes, ddp);
  EXPECT_DOUBLE_EQ(estimate_traffic(2, options).data_parallel_bytes, ddp);
  EXPECT_DOUBLE_EQ(estimate_traffic(3, options).data_parallel_bytes, 1.5 * ddp);
  // Stage 3 gathers again in every micro-batch; the gradients go once.
  EXPECT_DOUBLE_EQ(estimate_traffic(3, options, {}, 4).data_parallel_bytes, 4.5 * ddp);
  EXPECT_DOUBLE_EQ(estimate_traffic(2, options, {}, 4).data_parallel_bytes, ddp);
  // fp32 communication doubles it; one rank sends nothing.
  EXPECT_DOUBLE_EQ(estimate_traffic(2, EstimateOptions(options).precision(PrecisionRecipe::kFp32))
                       .data_parallel_bytes,
                   2 * ddp);
  EXPECT_EQ(estimate_traffic(3, EstimateOptions(options).world_size(1)).total_bytes(), 0);
}

TEST(TrafficEstimatorTest, TensorAndPipelineDegreesMoveActivationsNotParameters) {
  // The seeds' 175B on 64 ranks as TP 8 x PP 4 x DP 2, GPT-3's shape
  // (96 layers, hidden 12288, sequence 2048), micro-batch 1, 8 micro-batches.
  auto options = EstimateOptions()
                     .num_params(175e9)
                     .world_size(64)
                     .tensor_parallel_size(8)
                     .pipeline_parallel_size(4);
  auto shape = TransformerShape().layers(96).hidden(12288).sequence_length(2048).micro_batch(1);
  const TrafficEstimate e = estimate_traffic(1, options, shape, 8);
  const double activation = 2048.0 * 12288 * 2;  // one micro-batch at a layer boundary
  // ZeRO over DP 2 on the 1/32 slice: half of 2Ψ/32.
  EXPECT_NEAR(e.data_parallel_bytes, 175e9 / 32 * 2 * 2 * 0.5, 1);
  // 24 layers here, 4 all-reduces each, 2 x 7/8 of the activation per all-reduce.
  EXPECT_NEAR(e.tensor_parallel_bytes, 8 * 24 * 4 * 2 * 7.0 / 8 * activation, 1);
  // A middle stage sends forward and back.
  EXPECT_NEAR(e.pipeline_parallel_bytes, 8 * 2 * activation, 1);
  // Recomputation adds the forward's two all-reduces again; PP 2 sends one way.
  EXPECT_NEAR(estimate_traffic(1, options, TransformerShape(shape).checkpointing(true), 8)
                      .tensor_parallel_bytes /
                  e.tensor_parallel_bytes,
              1.5, 1e-12);
  EXPECT_NEAR(estimate_traffic(1, EstimateOptions(options).pipeline_parallel_size(2).world_size(32),
                               shape, 8)
                  .pipeline_parallel_bytes,
              8 * activation, 1);
  EXPECT_THROW(estimate_traffic(1, EstimateOptions(options).world_size(60), shape), c10::Error);
}

}  // namespace
}  // namespace zeroshard
