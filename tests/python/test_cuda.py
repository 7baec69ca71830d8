"""CUDA tensors through every implemented stage (run by scripts/gpu_check.sh).

These tests need an NVIDIA GPU; on a machine without one they are skipped, and
the rest of the suite covers the same code on CPU. World size 1 uses NCCL;
world size 2 shares the one GPU over Gloo, which stages CUDA tensors through
host memory. The reference is torch.optim on the same GPU (single-tensor
path, as on CPU), so the 1e-6 bound of the CPU tests applies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import TinyNet, make_model, max_abs_diff, param_groups, snapshot, train

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run scripts/gpu_check.sh there)"
)

STEPS = 10
TOLERANCE = 1e-6


class OnGpu(torch.nn.Module):
    """Feeds the CPU batches of tiny_models.train to a model on the GPU."""

    def __init__(self, model: TinyNet) -> None:
        super().__init__()
        self.inner = model

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        return self.inner(tokens.cuda(), step).cpu()


def _reference() -> dict[str, torch.Tensor]:
    model = make_model(seed=0).cuda()
    optimizer = torch.optim.AdamW(
        param_groups(model, (1e-2, 5e-3)), weight_decay=0.1, foreach=False
    )
    train(OnGpu(model), optimizer, STEPS, rank=0, world_size=1)
    return {k: v.cpu() for k, v in snapshot(model).items()}


def _train(
    rank: int, world_size: int, stage: int, backend: str, offload: dict | None = None
) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    torch.cuda.set_device(0)
    group = dist.new_group(backend=backend) if backend == "nccl" else None
    model = make_model(seed=0).cuda()
    stage3 = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(
        param_groups(model, (1e-2, 5e-3)),
        "adamw",
        stage=stage,
        weight_decay=0.1,
        reduce_bucket_size=64,
        process_group=group,
        **stage3,
        **(offload or {}),
    )
    train(OnGpu(model), optimizer, STEPS, rank, world_size)
    stats = optimizer.nvme_stats()
    if stats is not None:  # which I/O back end the GPU machine's build runs
        print(f"NVMe I/O back end: {stats['backend']}", flush=True)
    with optimizer.gathered_parameters():
        return {k: v.cpu() for k, v in snapshot(model).items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_world_size_one_over_nccl_matches_torch_optim(stage: int) -> None:
    (result,) = unwrap(run_ranks(1, _train, stage, "nccl"))
    diff = max_abs_diff(result, _reference())
    print(f"CUDA/NCCL stage {stage}: max abs diff {diff:.3e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_two_ranks_on_one_gpu_over_gloo(stage: int) -> None:
    results = unwrap(run_ranks(2, _train, stage, "gloo"))
    expected = _reference()
    for rank, result in enumerate(results):
        diff = max_abs_diff(result, expected)
        print(f"CUDA/Gloo stage {stage} rank {rank}: max abs diff {diff:.3e}")
        assert diff <= TOLERANCE


# CPU offload with a real device: pinned host buffers, non-blocking copies
# fenced by CUDA events, sub-groups alternating between two staging slots, and
# at stage 3 parameter shards in host memory. With every sub-group offloaded
# (all but the ratio 0.5 case) the gradient shard is on the host and each
# reduced bucket reaches it on a side stream during backward.
_OFFLOAD = {
    "stage1": (
        1,
        {"offload_optimizer": {"device": "cpu", "pin_memory": True}, "sub_group_size": 50},
    ),
    "stage2_ratio_half": (
        2,
        {
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.5},
            "sub_group_size": 50,
        },
    ),
    "stage2": (
        2,
        {"offload_optimizer": {"device": "cpu", "pin_memory": True}, "sub_group_size": 50},
    ),
    "stage3": (
        3,
        {
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "sub_group_size": 50,
        },
    ),
}


@pytest.mark.parametrize("case", list(_OFFLOAD))
def test_cuda_cpu_offload_matches_torch_optim(case: str) -> None:
    stage, offload = _OFFLOAD[case]
    (result,) = unwrap(run_ranks(1, _train, stage, "nccl", offload))
    diff = max_abs_diff(result, _reference())
    print(f"CUDA/NCCL {case} with CPU offload: max abs diff {diff:.3e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("stage", [2, 3])
def test_cuda_cpu_offload_two_ranks_over_gloo(stage: int) -> None:
    # Real asynchronous reduce-scatters (world size 1 makes them a local
    # copy) feeding the host gradient shard, with pageable state memory: the
    # receiver's side-stream copies into its own pinned staging.
    offload: dict = {"offload_optimizer": {"device": "cpu", "pin_memory": False}}
    if stage == 3:
        offload["offload_param"] = {"device": "cpu", "pin_memory": False}
    results = unwrap(run_ranks(2, _train, stage, "gloo", offload))
    expected = _reference()
    for rank, result in enumerate(results):
        diff = max_abs_diff(result, expected)
        print(f"CUDA/Gloo stage {stage} rank {rank} with CPU offload: max abs diff {diff:.3e}")
        assert diff <= TOLERANCE


# ZeRO-Infinity with a real device: optimizer state and stage 3 parameter
# shards in swap files, read into pinned host buffers and copied to the GPU
# ahead of the all-gather; small sub-groups so several pipeline per step.
def _nvme(path: Path) -> dict:
    return {"device": "nvme", "nvme_path": str(path), "pin_memory": True}


@pytest.mark.parametrize(("stage", "swap_gradients"), [(2, False), (3, False), (3, True)])
def test_cuda_nvme_offload_matches_torch_optim(
    stage: int, swap_gradients: bool, tmp_path: Path
) -> None:
    # swap_gradients: each reduced slice leaves the GPU with a blocking copy
    # into the gradient swap's blocks (never run on a GPU before).
    optimizer_offload = {**_nvme(tmp_path), "buffer_count": 4, "swap_gradients": swap_gradients}
    offload = {"offload_optimizer": optimizer_offload, "sub_group_size": 50}
    if stage == 3:
        # max_in_cpu 0: every parameter shard lives in the swap file.
        offload["offload_param"] = {**_nvme(tmp_path), "max_in_cpu": 0}
    (result,) = unwrap(run_ranks(1, _train, stage, "nccl", offload))
    diff = max_abs_diff(result, _reference())
    print(
        f"CUDA/NCCL stage {stage} with NVMe offload (swap_gradients {swap_gradients}): "
        f"max abs diff {diff:.3e}"
    )
    assert diff <= TOLERANCE


# [Note: host syncs, counted]: on the GPU, the counter against CUDA's own
# report of synchronizing calls (torch.cuda.set_sync_debug_mode), per step
# after warm-up: within the budget of docs/gpu.md, and never fewer than CUDA
# reports beyond what the same steps with torch.optim report (the model's own
# syncs): a sync the counter missed would show here.
def _reported_syncs(step: Any, steps: int) -> int:
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _syncs_on_gpu(rank: int, world_size: int, stage: int, backend: str) -> dict[str, int]:
    import torch.distributed as dist

    torch.cuda.set_device(0)
    group = dist.new_group(backend=backend) if backend == "nccl" else None
    tokens = torch.randint(0, 16, (4, 8), device="cuda")
    out = {}
    for kind in ("torch_optim", "zeroshard"):
        model = make_model(seed=0).cuda().to(torch.bfloat16)
        if kind == "torch_optim":
            optimizer: Any = torch.optim.AdamW(model.parameters())
        else:
            stage3 = {"module": model} if stage == 3 else {}
            optimizer = zeroshard.ZeroOptimizer(
                model.parameters(), "adamw", stage=stage, process_group=group, **stage3
            )

        def step(model: Any = model, optimizer: Any = optimizer) -> None:
            optimizer.zero_grad()
            model(tokens, 0).float().pow(2).mean().backward()
            optimizer.step()

        for _ in range(2):
            step()
        if kind == "zeroshard":
            before = sum(optimizer.host_sync_counts().values())
        out[kind] = _reported_syncs(step, 3)
    out["counted"] = sum(optimizer.host_sync_counts().values()) - before
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("world_size", "backend"), [(1, "nccl"), (2, "gloo")])
def test_cuda_host_syncs_per_step_within_budget(world_size: int, backend: str, stage: int) -> None:
    for rank, result in enumerate(unwrap(run_ranks(world_size, _syncs_on_gpu, stage, backend))):
        print(f"CUDA {backend} stage {stage} rank {rank}, 3 steps: {result}")
        assert result["counted"] <= 2 * 3, result
        if backend == "nccl":  # Gloo stages CUDA tensors through the host itself
            assert result["zeroshard"] - result["torch_optim"] <= result["counted"], result


def _on_another_device(rank: int, world_size: int) -> dict[str, str]:
    torch.cuda.set_device(0)  # left at GPU 0: the parameters are on GPU 1
    model = make_model(seed=0).to("cuda:1")
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), "adamw", stage=3, module=model, stage3_param_persistence_threshold=0
    )
    tokens = torch.randint(0, 16, (4, 8), device="cuda:1")
    optimizer.zero_grad()
    model(tokens, 0).float().pow(2).mean().backward()
    optimizer.step()
    with optimizer.gathered_parameters():
        return {n: str(p.device) for n, p in model.named_parameters()}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_parameters_on_another_device_than_the_current_one() -> None:
    for devices in unwrap(run_ranks(2, _on_another_device)):
        assert set(devices.values()) == {"cuda:1"}, devices
