"""Stage 1 reduces during backward (overlap_comm) and still equals torch.optim.

See [Note: stage 1 overlap] in csrc/grads/gradient_reduction.cpp: the hooks
copy each gradient into the buckets during backward while .grad stays as it
was; a second backward before the step, or any change to a .grad after its
hook, makes step() reduce from .grad instead. Each case runs on 2 and 3 ranks
and is compared with single-process torch.optim on the same global batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import (
    VOCAB,
    assert_ranks_match_reference,
    global_batch,
    local_batch,
    make_model,
    snapshot,
)

STEPS = 6
TOLERANCE = 1e-6
# Adam is nearly blind to a rescaled gradient, so the modes that edit .grad
# train with SGD, whose step is proportional to it.
SGD_MODES = ("scale_grads", "replace_grad")


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
    logits = model(tokens, step)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _edit(model: nn.Module, mode: str) -> None:
    """What a script does between backward and step in each mode."""
    if mode == "scale_grads":  # e.g. an unscale, or a manual clip of .grad
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)
    elif mode == "replace_grad":
        first = next(p for p in model.parameters() if p.grad is not None)
        first.grad = first.grad * 0.25


def _backward_and_edit(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, step: int, mode: str
) -> list[str] | None:
    """One step's backward pass(es) and edits; names of the parameters with .grad."""
    if mode == "two_backwards":
        half = tokens.shape[0] // 2
        for sl in (slice(0, half), slice(half, None)):
            (_loss(model, tokens[sl], targets[sl], step) / 2).backward()
        return None
    _loss(model, tokens, targets, step).backward()
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    _edit(model, mode)
    return with_grad


def _reference(mode: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    model = make_model(seed=0)
    if mode in SGD_MODES:
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens, targets = global_batch(step)
        with_grad = _backward_and_edit(model, tokens, targets, step, mode)
        optimizer.step()
    return snapshot(model), with_grad


def _train(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    model = make_model(seed=rank)
    if mode in SGD_MODES:
        hyper: dict[str, Any] = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}
    else:
        hyper = {"optimizer": "adamw", "lr": 1e-2}
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), stage=1, reduce_bucket_size=64, stage1_reduce_in_backward=True, **hyper
    )
    first_launch, last_hook, with_grad = None, None, None
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens, targets = local_batch(step, rank, world_size)
        # Step 2: the launch order was rebuilt from step 0's completion order
        # (layout order waits for the embedding, whose gradient comes last),
        # and the parameter unused on odd steps has a gradient again.
        if step == 2:
            optimizer.set_event_log_enabled(True)
        with_grad = _backward_and_edit(model, tokens, targets, step, mode)
        if step == 2:
            log = optimizer.event_log()
            kinds = [event for event, *_ in log]
            launches = [
                i for i, e in enumerate(log) if e[0] == "launch" and e[1] == "reduce_scatter"
            ]
            first_launch = launches[0] if launches else None
            last_hook = max(i for i, k in enumerate(kinds) if k == "grad_ready")
            optimizer.set_event_log_enabled(False)
        optimizer.step()
    return {
        "params": snapshot(model),
        "first_launch": first_launch,
        "last_hook": last_hook,
        "with_grad": with_grad,
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["plain", "two_backwards", "scale_grads", "replace_grad"])
def test_stage1_overlap_equals_torch_optim(mode: str, world_size: int) -> None:
    results = unwrap(run_ranks(world_size, _train, mode))
    expected, with_grad = _reference(mode)
    assert_ranks_match_reference(
        [r["params"] for r in results], expected, TOLERANCE, f"stage1 {mode} W={world_size}"
    )
    for result in results:
        # Stage 1 keeps .grad after backward, as torch.optim sees it.
        assert result["with_grad"] == with_grad
        if mode != "two_backwards":
            # The first bucket's reduce-scatter left during backward.
            assert result["first_launch"] is not None
            assert result["first_launch"] < result["last_hook"], result
