"""A model moved or changed after the optimizer was built: it trains as
torch.optim would, or every rank raises; it never silently stops learning.

Before [Note: parameters that left the optimizer's storage], ``model.to("cpu:0")``
after building the optimizer (what Hugging Face Trainer does) gave each
parameter a copy: the steps updated zeroshard's buffer, the model kept its
copy, and after training every weight was bit-identical to its start.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from dist_harness import RankError, run_ranks, unwrap
from tiny_models import (
    SEQ,
    VOCAB,
    assert_ranks_match_reference,
    gathered_snapshot,
    make_gpt,
    max_abs_diff,
)

STEPS = 4
BATCH = 6
LR = 1e-2
TOLERANCE = 1e-6


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(30_000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    per_rank = BATCH // world_size
    return tokens[rank * per_rank : (rank + 1) * per_rank], targets[
        rank * per_rank : (rank + 1) * per_rank
    ]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, world: int):
    tokens, targets = _batch(step, rank, world)
    optimizer.zero_grad()
    logits = model(tokens, step)
    nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
    optimizer.step()


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = make_gpt(seed=0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        _step(model, optimizer, step, 0, 1)
    return start, {n: p.detach().clone() for n, p in model.named_parameters()}


def _optimizer(model: nn.Module, stage: int, persist: int = 50) -> zeroshard.ZeroOptimizer:
    # At stage 3 the units under `persist` elements stay gathered (a copy of
    # them is a real copy) and the others are released (a move answers with
    # the parameter itself).
    return zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=stage,
        module=model if stage == 3 else None,
        stage3_param_persistence_threshold=persist,
        lr=LR,
    )


def _train_after(rank: int, world: int, stage: int, change: str) -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = _optimizer(model, stage)
    storage = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    if change == "to_cpu0":
        model.to("cpu:0")
    elif change == "data_copy":  # what Module._apply does when it copies
        for p in model.parameters():
            if p.untyped_storage().nbytes():  # released stage-3 ones have nothing to copy
                p.data = p.data.clone()
    copied = sum(p.untyped_storage().data_ptr() != storage[n] for n, p in model.named_parameters())
    for step in range(STEPS):
        _step(model, optimizer, step, rank, world)
    return {"params": gathered_snapshot(model, optimizer), "copied": copied}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("change", ["to_cpu0", "data_copy"])
def test_a_model_copied_after_construction_trains_as_torch_optim(stage: int, change: str) -> None:
    start, expected = _reference()
    results = unwrap(run_ranks(3, _train_after, stage, change))  # 3 divides nothing here
    copied = [r["copied"] for r in results]
    if stage == 3 and change == "to_cpu0":
        # Stage-3 parameters answer a conversion that changes nothing with
        # themselves ([Note: a released parameter refuses reads]).
        assert copied == [0, 0, 0], copied
    else:
        # The change did give parameters new storage (else this shows nothing).
        assert all(c > 0 for c in copied), copied
    params = [r["params"] for r in results]
    assert max_abs_diff(params[0], start) > 1e-3  # the weights moved
    assert_ranks_match_reference(params, expected, TOLERANCE, f"stage{stage}/{change}")


def _refused(rank: int, world: int, stage: int, change: str, persist: int = 10**6) -> None:
    model = make_gpt(seed=0)
    optimizer = _optimizer(model, stage, persist)
    if change == "to_float64":
        model.to(torch.float64)
    elif change == "other_values_on_rank1" and rank == 1:
        first = next(model.parameters())
        first.data = torch.randn_like(first)
    for step in range(STEPS):
        _step(model, optimizer, step, rank, world)


@pytest.mark.parametrize("stage", [1, 2, 3])  # stage 3: every parameter persistent
@pytest.mark.parametrize("change", ["to_float64", "other_values_on_rank1"])
def test_a_model_changed_after_construction_raises_on_every_rank(stage: int, change: str) -> None:
    results = run_ranks(2, _refused, stage, change)
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), f"rank {rank} trained on: {result}"
        assert result.type_name == "RuntimeError", result
        message = result.message
        assert "step() refused" in message and "no longer use the optimizer's storage" in message
        assert re.search(r"'[\w.]+' (was|has)", message), message  # names the parameter
        expected = "converted to Double" if change == "to_float64" else "rank 1: "
        assert expected in message, message
        assert "before building the ZeroOptimizer" in message, message


def test_stage3_conversion_of_released_parameters_raises() -> None:
    # Released parameters have no values to convert: the conversion itself
    # raises, on every rank, before anything trains.
    results = run_ranks(2, _refused, 3, "to_float64", 0)
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), f"rank {rank} trained on: {result}"
        assert "Tensor.to cannot read parameter" in result.message, result.message
