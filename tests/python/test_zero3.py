"""ZeRO-3 (parameters sharded, gathered per unit) against single-process torch.optim.

The model is a small GPT (tests/python/tiny_models.py): token embedding tied
to the output head, a position table owned by the root module, layer norms,
a layer norm called twice per block, optionally the last block under
torch.utils.checkpoint. Each step splits a global batch across the ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import (
    SEQ,
    VOCAB,
    Block,
    assert_ranks_match_reference,
    make_gpt,
    make_model,
    param_groups,
    snapshot,
)

STEPS = 10
TOLERANCE = 1e-6
BATCH = 12  # sequences per micro-batch: divisible by 2, 3 and 4

# name: (model, optimizer, hyper-parameters, zeroshard options, micro-batches, clip)
CONFIGS: dict[str, tuple[dict[str, Any], str, dict[str, Any], dict[str, Any], int, float]] = {
    "gpt_adamw": ({}, "adamw", {"weight_decay": 0.1}, {}, 1, 0.0),
    "gpt_block_units": ({}, "adamw", {}, {"unit_classes": (Block,), "persist": 10}, 1, 0.0),
    "gpt_checkpoint_reentrant": ({"checkpoint_mode": "reentrant"}, "adamw", {}, {}, 1, 0.0),
    "gpt_checkpoint_non_reentrant": (
        {"checkpoint_mode": "non_reentrant"},
        "adamw",
        {},
        {},
        2,
        0.0,
    ),
    "gpt_no_prefetch_accumulate_clip": (
        {},
        "sgd",
        {"momentum": 0.9},
        {"stage3_prefetch_bucket_size": 0},
        2,
        0.5,
    ),
    "gpt_order_changes": ({"vary_order": True}, "adamw", {}, {}, 1, 0.0),
    "tinynet_groups": ({"tinynet": True}, "sgd", {"momentum": 0.9}, {}, 1, 0.0),
}
_TORCH_OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_LR = {"adamw": 1e-2, "sgd": 0.05}


def _model(spec: dict[str, Any]) -> nn.Module:
    if spec.get("tinynet"):
        return make_model(seed=0)
    return make_gpt(
        seed=0,
        checkpoint_mode=spec.get("checkpoint_mode"),
        vary_order=spec.get("vary_order", False),
    )


def _params(model: nn.Module, spec: dict[str, Any], lr: float) -> Any:
    if spec.get("tinynet"):
        return param_groups(model, (lr, 2 * lr))
    return model.parameters()


def micro_batch(step: int, micro: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(20_000 + 100 * step + micro)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    per_rank = BATCH // world_size
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return tokens[sl], targets[sl]


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, step: int):
    logits = model(tokens, step)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference(name: str) -> dict[str, torch.Tensor]:
    spec, kind, hyper, _, accumulation, clip = CONFIGS[name]
    model = _model(spec)
    optimizer = _TORCH_OPTIMIZERS[kind](_params(model, spec, _LR[kind]), lr=_LR[kind], **hyper)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            tokens, targets = micro_batch(step, micro, 0, 1)
            (loss_of(model, tokens, targets, step) / accumulation).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return snapshot(model)


def make_stage3(model: nn.Module, spec: dict[str, Any], kind: str, hyper, options) -> Any:
    options = dict(options)
    persist = options.pop("persist", 0)
    return zeroshard.ZeroOptimizer(
        _params(model, spec, _LR[kind]),
        kind,
        stage=3,
        module=model,
        stage3_param_persistence_threshold=persist,
        lr=_LR[kind],
        **options,
        **hyper,
    )


def _train(rank: int, world_size: int, name: str) -> dict[str, Any]:
    spec, kind, hyper, options, accumulation, clip = CONFIGS[name]
    torch.manual_seed(rank)  # ranks start different: construction broadcasts rank 0's values
    model = _model(spec) if rank == 0 else _perturbed(_model(spec))
    optimizer = make_stage3(model, spec, kind, hyper, dict(options, max_norm=clip or None))
    gathered_between_steps = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            tokens, targets = micro_batch(step, micro, rank, world_size)
            (loss_of(model, tokens, targets, step) / accumulation).backward()
        optimizer.step()
        gathered_between_steps.append(optimizer.gathered_parameter_bytes())
    with optimizer.gathered_parameters():
        params = snapshot(model)
    return {"params": params, "gathered_between_steps": gathered_between_steps}


def _perturbed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def _train_all(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    return {name: _train(rank, world_size, name) for name in names}


# Every config at world size 3 (divides nothing in the model); the core ones
# at 2 and 4 too, to keep the suite fast on two cores.
_WORLD_CONFIGS = {
    2: ["gpt_adamw", "gpt_checkpoint_reentrant", "gpt_order_changes"],
    3: list(CONFIGS),
    4: ["gpt_adamw", "gpt_checkpoint_non_reentrant", "gpt_block_units"],
}


_RESULTS: dict[int, list[dict[str, Any]]] = {}


def trained(world_size: int) -> list[dict[str, Any]]:
    """One multi-process run per world size, shared by the tests below."""
    if world_size not in _RESULTS:
        _RESULTS[world_size] = unwrap(
            run_ranks(world_size, _train_all, _WORLD_CONFIGS[world_size])
        )
    return _RESULTS[world_size]


@pytest.mark.parametrize(
    ("world_size", "name"), [(w, n) for w, names in _WORLD_CONFIGS.items() for n in names]
)
def test_stage3_matches_torch_optim_after_ten_steps(world_size: int, name: str) -> None:
    results = trained(world_size)
    assert_ranks_match_reference(
        [r[name]["params"] for r in results],
        reference(name),
        TOLERANCE,
        f"stage 3 world_size={world_size} {name}",
    )
    for rank, r in enumerate(results):
        between = r[name]["gathered_between_steps"]
        print(f"rank {rank}: gathered parameter bytes between steps {between[:3]}...")
        if CONFIGS[name][3].get("persist", 0) == 0:
            # No persistence threshold: nothing stays gathered between steps.
            assert between == [0] * STEPS, (rank, name)
        else:
            assert 0 < between[0] and all(b == between[0] for b in between), (rank, name)
