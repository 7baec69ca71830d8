"""DeepSpeed ZeRO checkpoints resume in zeroshard (zeroshard.deepspeed_migration).

DeepSpeed (fp32, AdamW, a WarmupLR schedule, ZeRO stage 1, 2 or 3) trains the
small GPT of tiny_models.py (tied embedding/head) for 3 steps on 2 CPU ranks,
saves, and trains 3 more. zeroshard, at world size 2 and 3, builds the same
model from another seed, loads the DeepSpeed checkpoint through
``Engine.load_checkpoint`` (rank 0 converts it) and trains the same 3 steps on
the same global batches. Checked: the converted states equal DeepSpeed's own
consolidated ones bit for bit; the engine resumes DeepSpeed's step count,
learning rate and client state; after the 3 steps the parameters agree within
the bound measured below.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.checkpoint import read_index, read_states

from dist_harness import RankError, run_ranks, unwrap
from tiny_models import SEQ, VOCAB, make_gpt, max_abs_diff

BATCH = 12  # global batch, divisible by 2 and 3
SAVED_AT, STEPS_AFTER = 3, 3
LR = 1e-2
STATES = ("master", "exp_avg", "exp_avg_sq")
# The first DeepSpeed job of a machine JIT-compiles its CPU Adam (about 100 s on 2 cores).
DEEPSPEED_TIMEOUT = 600.0


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 10},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }


def _micro_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50_000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    per_rank = BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return tokens[rows], targets[rows]


def _train(engine: Any, steps: range, rank: int, world_size: int) -> None:
    """DeepSpeed's loop, which zeroshard's engine runs as is."""
    for step in steps:
        tokens, targets = _micro_batch(step, rank, world_size)
        logits = engine(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        engine.backward(loss)
        engine.step()


def _deepspeed_job(rank: int, world_size: int, stage: int, save_dir: str) -> dict[str, Any] | None:
    # DeepSpeed reads its rank and accelerator from the environment (as in
    # benchmarks/run_benchmarks.py); the Gloo group is dist_harness's.
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "DS_ACCELERATOR": "cpu",
        }
    )
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model = make_gpt(seed=0, width=16, hidden=24)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage)
    )
    _train(engine, range(SAVED_AT), rank, world_size)
    engine.save_checkpoint(save_dir, client_state={"next_step": SAVED_AT})
    # Whole states through DeepSpeed's own API (collectives: every rank calls them).
    named = list(model.named_parameters())
    saved = {
        "master": {name: safe_get_full_fp32_param(p) for name, p in named},
        **{
            state: {name: safe_get_full_optimizer_state(p, state) for name, p in named}
            for state in ("exp_avg", "exp_avg_sq")
        },
    }
    lr = engine.get_lr()
    _train(engine, range(SAVED_AT, SAVED_AT + STEPS_AFTER), rank, world_size)
    final = {name: safe_get_full_fp32_param(p) for name, p in named}
    if rank != 0:
        return None
    return {"saved": saved, "lr": lr, "final": final}


def _zeroshard_job(rank: int, world_size: int, stage: int, load_dir: str) -> dict[str, Any] | None:
    model = make_gpt(seed=1, width=16, hidden=24)  # other values: the load must replace them
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=_config(stage))
    path, client_state = engine.load_checkpoint(load_dir)  # tag: DeepSpeed's latest
    loaded = optimizer.full_state_dict(rank=0)
    resumed = {
        "path": path,
        "client_state": client_state,
        "global_steps": engine.global_steps,
        "lr": engine.get_lr(),
    }
    _train(engine, range(SAVED_AT, SAVED_AT + STEPS_AFTER), rank, world_size)
    final = optimizer.full_state_dict(rank=0)
    if rank != 0:
        return None
    return {"resumed": resumed, "loaded": loaded, "final": final}


def _canonical(params: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """zeroshard lists a tied parameter under every name; DeepSpeed under its first."""
    return {name: value for name, value in params.items() if name in names}


# The bound on the parameters 3 steps after the load, against DeepSpeed's own 3
# steps. The load itself is exact (checked below: the master weights after it
# equal DeepSpeed's bit for bit), so what remains is arithmetic, mostly
# DeepSpeed's CPU Adam (deepspeed/ops/csrc/includes/cpu_adam.h) against ATen's
# AdamW. DeepSpeed keeps beta^t and the bias corrections in fp32 (1 - 0.999^t
# loses ~1e-5 of its value to cancellation, so each update is off by ~6e-6 of
# itself, ~5e-8 here) and applies the weight decay and the update as separate
# fp32 roundings, 1-2 ulps of |w| per step; add the order in which each sums
# the gradients over the ranks (and, at world size 3, the other batch slices).
# Measured: max abs diff 9.5e-7 at stages 1, 2 and 3 and world sizes 2 and 3,
# on wte.weight at |w| = 2.28 (4 ulps of 2.4e-7); 1.6e-7 on the weights below
# 0.5. A mapping error is far larger (measured by corrupting the converted
# index at stage 2): step counts off by one 1.2e-3, the schedule one step
# behind 5.1e-3, the moments dropped 2.7e-2. The bound is 5x the rounding and
# 1/240 of the smallest of those.
BOUND = 5e-6


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_deepspeed_checkpoint(tmp_path: Path, stage: int) -> None:
    # Imported here, not at collection, so the rest of the suite never imports DeepSpeed.
    pytest.importorskip(
        "deepspeed", reason="DeepSpeed is not installed: this test converts checkpoints it writes"
    )
    save_dir = tmp_path / "deepspeed"
    reference = unwrap(
        run_ranks(2, _deepspeed_job, stage, str(save_dir), timeout=DEEPSPEED_TIMEOUT)
    )[0]
    names = set(reference["final"])
    moved = max_abs_diff(reference["final"], reference["saved"]["master"])

    for world_size in (2, 3):
        result = unwrap(run_ranks(world_size, _zeroshard_job, stage, str(save_dir)))[0]
        resumed = result["resumed"]
        assert resumed["path"] == str(save_dir / f"global_step{SAVED_AT}.zeroshard")
        assert resumed["global_steps"] == SAVED_AT
        assert resumed["client_state"] == {"next_step": SAVED_AT}
        assert resumed["lr"] == pytest.approx(reference["lr"], rel=1e-12)
        loaded = _canonical(result["loaded"], names)
        assert max_abs_diff(loaded, reference["saved"]["master"]) == 0.0
        diff = max_abs_diff(_canonical(result["final"], names), reference["final"])
        print(
            f"stage {stage}, zeroshard at world size {world_size}: max abs diff {diff:.3e} "
            f"(the 3 steps moved the parameters by up to {moved:.3e})"
        )
        assert diff <= BOUND, (stage, world_size, diff)

    # The conversion, against DeepSpeed's own consolidated states: bit for bit.
    converted = save_dir / f"global_step{SAVED_AT}.zeroshard"
    states = read_states(converted)
    for state in STATES:
        assert states[state].keys() == names, state
        for name in names:
            assert torch.equal(states[state][name], reference["saved"][state][name]), (state, name)
    index = read_index(converted)
    assert {p["step"] for p in index["params"]} == {SAVED_AT}
    assert index["inner_optimizer"] == "adamw"
    assert [p["aliases"] for p in index["params"] if p["name"] == "wte.weight"] == [["head.weight"]]
    assert index["replicated"]["engine"]["scheduler_steps"] == SAVED_AT
    assert index["replicated"]["deepspeed"]["unmapped"] == []


def _load_job(rank: int, world_size: int, load_dir: str) -> None:
    model = make_gpt(seed=0, width=16, hidden=24)
    engine, _, _, _ = zeroshard.initialize(model=model, config=_config(2))
    engine.load_checkpoint(load_dir, tag="global_step3")


def test_failed_conversion_raises_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 converts; when that fails, every rank raises its message (none waits)."""
    tag_dir = tmp_path / "global_step3"
    tag_dir.mkdir()
    for rank in range(2):
        (tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"not a pickle")
    results = run_ranks(2, _load_job, str(tmp_path))
    for result in results:
        assert isinstance(result, RankError), result
        assert result.type_name == "ValueError"
        assert "could not convert DeepSpeed checkpoint" in result.message
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in result.message
    assert not (tmp_path / "global_step3.zeroshard").exists()
