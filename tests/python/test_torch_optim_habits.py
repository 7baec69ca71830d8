"""What scripts and libraries do with a torch.optim optimizer, done to ZeroOptimizer.

Named parameters (``model.named_parameters()``), ``optimizer.state[p]``,
``torch.amp.GradScaler`` and a gradient penalty (double backward), each at the
stages a new user tried them (issue #49), on 2 Gloo ranks against DDP +
torch.optim on the same ranks (or single-process torch.optim) as the yardstick,
every rank's weights compared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import (
    assert_ranks_match_reference,
    make_model,
    max_abs_diff,
    snapshot,
    train,
)

TOLERANCE = 1e-6
STEPS = 6
# Stage 3 releases every parameter after use (by default the tiny models'
# small tensors would stay gathered for good); ignored below stage 3.
RELEASED = {"stage3_param_persistence_threshold": 0}


def _full(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The model's full parameters (gathered at stage 3; collective)."""
    with optimizer.gathered_parameters():
        return snapshot(model)


# ---- named parameters (issue #49 item 8) ----------------------------------------


def _reference_named(steps: int) -> dict[str, torch.Tensor]:
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    train(model, optimizer, steps, 0, 1)
    return snapshot(model)


def _train_named(rank: int, world_size: int, stage: int, path: str) -> dict[str, Any]:
    model = make_model(seed=rank)
    module = {"module": model, **RELEASED} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(
        model.named_parameters(), "adamw", stage=stage, lr=1e-2, **module
    )
    train(model, optimizer, STEPS, rank, world_size)
    full = optimizer.full_state_dict()
    optimizer.save_checkpoint(path)
    # A fresh optimizer built with module= finds every state by those names.
    other = make_model(seed=7)
    loader = zeroshard.ZeroOptimizer(other.parameters(), "adamw", stage=1, lr=1e-2, module=other)
    loader.load_checkpoint(path)
    return {
        "params": _full(model, optimizer),
        "full_keys": sorted(full),
        "group_names": optimizer.param_groups[0]["param_names"],
        "loaded": snapshot(other),
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_named_parameters_are_accepted_and_name_checkpoints(stage: int, tmp_path) -> None:
    results = unwrap(run_ranks(2, _train_named, stage, str(tmp_path / "ckpt")))
    expected = _reference_named(STEPS)
    assert_ranks_match_reference(
        [r["params"] for r in results], expected, TOLERANCE, f"named stage {stage}"
    )
    names = [name for name, _ in make_model().named_parameters()]
    assert results[0]["group_names"] == names
    # Rank 0 gets the full state under the names the user gave (tied weights:
    # named_parameters() names them once; module=, needed at stage 3, names
    # them under every name).
    every = [name for name, _ in make_model().named_parameters(remove_duplicate=False)]
    assert results[0]["full_keys"] == sorted(every if stage == 3 else names)
    assert results[1]["full_keys"] == []
    for r in results:
        assert max_abs_diff(r["loaded"], results[0]["params"]) == 0.0


def _named_groups(rank: int, world_size: int) -> list[str]:
    model = make_model(seed=rank)
    named = list(model.named_parameters())
    optimizer = zeroshard.ZeroOptimizer(
        [{"params": named[:3], "lr": 1e-2}, {"params": named[3:]}], "sgd", stage=2, lr=0.1
    )
    train(model, optimizer, 2, rank, world_size)
    return sorted(optimizer.full_state_dict())


def test_named_parameter_groups_name_the_full_state() -> None:
    results = unwrap(run_ranks(2, _named_groups))
    assert results[0] == sorted(name for name, _ in make_model().named_parameters())
