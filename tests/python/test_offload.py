"""CPU offload (offload_optimizer, offload_param) against single-process torch.optim.

On this CPU-only machine the device and the host are the same memory; the
offload path still runs end to end (the gradient shard is copied to the host
staging buffer, the host kernel updates the master and moments there, the new
parameter values are copied back), so these tests cover its logic.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import VOCAB, local_batch, make_model, param_groups

STEPS = 10
LRS = (1e-2, 5e-3)
# fp32 bound of the brief; the measured differences (printed) are ~1e-7: the
# host kernel's FMAs and folded 1 / (world size x loss scale) move a value by
# at most an ulp per step (tests/cpp/test_host_optimizer_kernel.cpp).
TOLERANCE = 1e-6


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, step: int):
    logits = model(tokens, step)
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _micro(step: int, micro: int, rank: int, world_size: int):
    # Micro-batch `micro` of step `step`: the global batch of a shifted step.
    return local_batch(1000 * micro + step, rank, world_size)


def reference(accumulation: int, max_norm: float | None) -> list[torch.Tensor]:
    model = make_model(seed=0)
    groups = param_groups(model, LRS)
    optimizer = torch.optim.AdamW(groups, weight_decay=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            tokens, targets = _micro(step, micro, 0, 1)
            (_loss(model, tokens, targets, step) / accumulation).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return [p.detach().clone() for g in groups for p in g["params"]]


def _train(
    rank: int,
    world_size: int,
    stage: int,
    zero_kwargs: dict[str, Any],
    accumulation: int,
    max_norm: float | None,
    dtype: torch.dtype,
) -> dict[str, Any]:
    model = make_model(seed=0).to(dtype)
    kwargs = dict(zero_kwargs)
    if stage == 3:
        kwargs["module"] = model
    optimizer = zeroshard.ZeroOptimizer(
        param_groups(model, LRS),
        "adamw",
        stage=stage,
        weight_decay=0.1,
        max_norm=max_norm,
        **kwargs,
    )
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            tokens, targets = _micro(step, micro, rank, world_size)
            (_loss(model, tokens, targets, step) / accumulation).backward()
        optimizer.step()
    full = optimizer._impl.full_parameters(0)
    with optimizer.gathered_parameters():
        params = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    return {
        "master": [t for group in full for t in group],
        "params": params,
        "device_bytes": optimizer.device_model_state_bytes(),
        "host_bytes": optimizer.host_model_state_bytes(),
    }


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        ((x.float() - y.float()).abs().max().item() if x.numel() else 0.0)
        for x, y in zip(a, b, strict=True)
    )


# name: (stage, world size, ZeroOptimizer offload kwargs, micro-batches, max_norm)
CASES: dict[str, tuple[int, int, dict[str, Any], int, float | None]] = {
    "stage1_w2": (1, 2, {"offload_optimizer": "cpu"}, 1, None),
    "stage1_w3_clip_accumulate": (1, 3, {"offload_optimizer": "cpu"}, 2, 0.5),
    "stage2_w2_clip_accumulate": (2, 2, {"offload_optimizer": {"device": "cpu"}}, 2, 0.5),
    "stage2_w3": (2, 3, {"offload_optimizer": "cpu"}, 1, None),
    "stage2_w2_subgroups_ratio": (
        2,
        2,
        {"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "sub_group_size": 11},
        1,
        0.5,
    ),
    "stage3_w2_optimizer_only": (3, 2, {"offload_optimizer": "cpu"}, 1, None),
    "stage3_w2_params_too": (
        3,
        2,
        {"offload_optimizer": "cpu", "offload_param": "cpu", "sub_group_size": 17},
        2,
        0.5,
    ),
    "stage3_w3_params_too": (3, 3, {"offload_optimizer": "cpu", "offload_param": "cpu"}, 1, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_offload_matches_torch_optim(name: str) -> None:
    stage, world_size, kwargs, accumulation, max_norm = CASES[name]
    expected = reference(accumulation, max_norm)
    results = unwrap(
        run_ranks(world_size, _train, stage, kwargs, accumulation, max_norm, torch.float32)
    )
    for rank, result in enumerate(results):
        diff = _max_diff(result["params"], expected)
        print(f"{name} rank {rank}: max abs diff {diff:.3e}")
        assert diff <= TOLERANCE, (name, rank, diff)
        assert result["host_bytes"] > 0
    assert _max_diff(results[0]["master"], expected) <= TOLERANCE


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_offload_matches_bf16_without_offload(stage: int) -> None:
    # Same fp32 master math on the host and on the device; what can differ is
    # an ulp of the master (FMAs, see TOLERANCE), which flips the bf16
    # rounding of a parameter now and then; bf16's forward then carries it.
    offload: dict[str, Any] = {"offload_optimizer": "cpu"}
    if stage == 3:
        offload["offload_param"] = "cpu"
    plain = unwrap(run_ranks(2, _train, stage, {}, 2, 0.5, torch.bfloat16))[0]
    moved = unwrap(run_ranks(2, _train, stage, offload, 2, 0.5, torch.bfloat16))[0]
    master_diff = _max_diff(moved["master"], plain["master"])
    print(f"stage {stage}: bf16 master max abs diff {master_diff:.3e}")
    # bf16 holds 8 bits of mantissa: 4e-3 relative per rounding; 10 steps at lr 1e-2.
    assert master_diff <= 2e-3
    # The parameters the model uses are the master rounded to nearest even.
    for master, param in zip(moved["master"], moved["params"], strict=True):
        assert torch.equal(master.to(torch.bfloat16), param)
