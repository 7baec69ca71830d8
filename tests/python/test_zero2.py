"""ZeRO-2 (gradients sharded during backward) against single-process torch.optim.

Each step runs `accumulation` micro-batches; every micro-batch is split across
the ranks, and the reference sees the whole micro-batch. Losses are divided by
the number of micro-batches, as a user accumulating gradients does.
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
    assert_ranks_match_reference,
    make_model,
    max_abs_diff,
    param_groups,
    snapshot,
    train,
)

STEPS = 10
TOLERANCE = 1e-6
MICRO_BATCH = 12  # sequences per micro-batch: divisible by 2, 3 and 4
BUCKET = 40  # elements: several buckets, so communication overlaps backward

# name: (optimizer, hyper-parameters, micro-batches per step, clipping, use no_sync)
# clipping: None, ("option", max_norm) via ZeroOptimizer(max_norm=...), or
# ("method", max_norm) via optimizer.clip_grad_norm_().
CONFIGS: dict[str, tuple[str, dict[str, Any], int, Any, bool]] = {
    "adamw": ("adamw", {"weight_decay": 0.1}, 1, None, False),
    "adamw_accumulate4": ("adamw", {"weight_decay": 0.1}, 4, None, False),
    "adamw_clip": ("adamw", {}, 1, ("option", 0.5), False),
    "adamw_clip_accumulate4": ("adamw", {}, 4, ("option", 0.5), False),
    "adamw_accumulate4_no_sync": ("adamw", {}, 4, None, True),
    "sgd": ("sgd", {"momentum": 0.9}, 1, None, False),
    "sgd_no_overlap": ("sgd", {"momentum": 0.9, "overlap_comm": False}, 1, None, False),
    "adamw_checkpoint_reentrant": ("adamw", {"checkpoint": "reentrant"}, 1, None, False),
    "adamw_checkpoint_non_reentrant": ("adamw", {"checkpoint": "non_reentrant"}, 2, None, False),
    "sgd_clip_method_accumulate4": ("sgd", {"momentum": 0.9}, 4, ("method", 0.3), False),
}
_TORCH_OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_LRS = {"adamw": (1e-2, 5e-3), "sgd": (0.05, 0.1)}


def micro_batch(step: int, micro: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
    per_rank = MICRO_BATCH // world_size
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return tokens[sl], targets[sl]


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, step: int):
    logits = model(tokens, step)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference(name: str) -> dict[str, torch.Tensor]:
    kind, hyper, accumulation, clipping, _ = CONFIGS[name]
    checkpoint_mode = hyper.get("checkpoint")
    hyper = {k: v for k, v in hyper.items() if k not in ("overlap_comm", "checkpoint")}
    model = make_model(seed=0, checkpoint_mode=checkpoint_mode)
    optimizer = _TORCH_OPTIMIZERS[kind](param_groups(model, _LRS[kind]), **hyper)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            tokens, targets = micro_batch(step, micro, 0, 1)
            (loss_of(model, tokens, targets, step) / accumulation).backward()
        if clipping is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clipping[1])
        optimizer.step()
    return snapshot(model)


def _train(rank: int, world_size: int, name: str) -> dict[str, Any]:
    kind, hyper, accumulation, clipping, use_no_sync = CONFIGS[name]
    checkpoint_mode = hyper.get("checkpoint")
    hyper = {k: v for k, v in hyper.items() if k != "checkpoint"}
    model = make_model(seed=rank, checkpoint_mode=checkpoint_mode)
    max_norm = clipping[1] if clipping and clipping[0] == "option" else None
    optimizer = zeroshard.ZeroOptimizer(
        param_groups(model, _LRS[kind]),
        kind,
        stage=2,
        reduce_bucket_size=BUCKET,
        max_norm=max_norm,
        **hyper,
    )
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            tokens, targets = micro_batch(step, micro, rank, world_size)
            last = micro == accumulation - 1
            if use_no_sync and not last:
                with optimizer.no_sync():
                    (loss_of(model, tokens, targets, step) / accumulation).backward()
            else:
                (loss_of(model, tokens, targets, step) / accumulation).backward()
        if clipping and clipping[0] == "method":
            norms.append(optimizer.clip_grad_norm_(clipping[1]).item())
        optimizer.step()
    return {"params": snapshot(model), "norms": norms}


def _measure(rank: int, world_size: int) -> dict[str, Any]:
    """Memory, event order and bytes of one stage-2 step."""
    model = make_model(seed=0)
    optimizer = zeroshard.ZeroOptimizer(
        param_groups(model, (1e-2, 1e-2)), "adamw", stage=2, reduce_bucket_size=BUCKET
    )
    tokens, targets = micro_batch(0, 0, rank, world_size)
    optimizer.zero_grad()
    optimizer.reset_comm_stats()
    optimizer.reset_peak_staging_bytes()
    optimizer.set_event_log_enabled(True)
    loss_of(model, tokens, targets, 0).backward()
    after_backward = {
        "gradient_bytes": optimizer.gradient_bytes(),
        "peak_staging_bytes": optimizer.peak_staging_bytes(),
        "grads_left": sum(p.grad is not None for p in model.parameters()),
    }
    optimizer.step()
    impl = optimizer._impl
    # The same backward with overlap_comm=False, for contrast.
    serial_model = make_model(seed=0)
    serial = zeroshard.ZeroOptimizer(
        serial_model.parameters(), "adamw", stage=2, reduce_bucket_size=BUCKET, overlap_comm=False
    )
    serial.set_event_log_enabled(True)
    loss_of(serial_model, tokens, targets, 0).backward()
    serial_log = serial.event_log()
    serial.step()
    return {
        **after_backward,
        "serial_log": serial_log,
        "log": optimizer.event_log(),
        "stats": optimizer.comm_stats(),
        "flat_numels": [impl.flat_numel(g) for g in range(2)],
        "shard_numels": [impl.shard_numel(g) for g in range(2)],
        "param_numels": [impl.param_numel(g) for g in range(2)],
        "num_buckets": [impl.num_buckets(g) for g in range(2)],
        "num_params": sum(len(g["params"]) for g in optimizer.param_groups),
    }


def _train_all(rank: int, world_size: int) -> dict[str, Any]:
    out = {name: _train(rank, world_size, name) for name in CONFIGS}
    out["measure"] = _measure(rank, world_size)
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def trained(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, unwrap(run_ranks(request.param, _train_all))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stage2_matches_torch_optim_after_ten_steps(trained, name: str) -> None:
    world_size, results = trained
    assert_ranks_match_reference(
        [r[name]["params"] for r in results],
        reference(name),
        TOLERANCE,
        f"stage 2 world_size={world_size} {name}",
    )


def test_clip_grad_norm_returns_the_unsharded_total_norm(trained) -> None:
    world_size, results = trained
    # The norm a single process computes on the same gradients, step by step.
    kind, hyper, accumulation, (_, max_norm), _ = CONFIGS["sgd_clip_method_accumulate4"]
    model = make_model(seed=0)
    optimizer = _TORCH_OPTIMIZERS[kind](param_groups(model, _LRS[kind]), **hyper)
    expected = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            tokens, targets = micro_batch(step, micro, 0, 1)
            (loss_of(model, tokens, targets, step) / accumulation).backward()
        expected.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
    for result in results:
        got = result["sgd_clip_method_accumulate4"]["norms"]
        print(f"world_size={world_size} norms {got[:3]} expected {expected[:3]}")
        assert got == pytest.approx(expected, rel=1e-5)
        assert any(n > max_norm for n in got), "clipping must have been active"


def test_gradient_memory_after_backward_is_the_shard(trained) -> None:
    world_size, results = trained
    for rank, result in enumerate(results):
        m = result["measure"]
        shard_bytes = sum(m["shard_numels"]) * 4
        bucket_bytes = BUCKET * 4
        full_bytes = sum(m["param_numels"]) * 4
        print(
            f"world_size={world_size} rank={rank}: gradient bytes after backward "
            f"{m['gradient_bytes']} (shard {shard_bytes}, full model {full_bytes}), "
            f"peak staging during backward {m['peak_staging_bytes']}"
        )
        assert m["grads_left"] == 0
        assert m["gradient_bytes"] <= shard_bytes + 2 * bucket_bytes
        assert m["gradient_bytes"] < full_bytes


def _launches_and_hooks(log: list[tuple[str, str, int, str]]) -> tuple[list[int], list[int]]:
    """Positions in the event log of reduce-scatter launches and gradient hooks."""
    launches = [i for i, e in enumerate(log) if e[0] == "launch" and e[1] == "reduce_scatter"]
    hooks = [i for i, e in enumerate(log) if e[0] == "grad_ready"]
    assert launches and hooks
    return launches, hooks


def test_first_reduce_scatter_launches_before_the_last_gradient_hook(trained) -> None:
    _, results = trained
    for result in results:
        log = result["measure"]["log"]
        launches, hooks = _launches_and_hooks(log)
        print(
            f"first reduce-scatter at event {launches[0]}, last hook at {hooks[-1]} of {len(log)}"
        )
        assert launches[0] < hooks[-1]


def test_without_overlap_the_reduce_scatters_wait_for_the_end_of_backward(trained) -> None:
    _, results = trained
    for result in results:
        launches, hooks = _launches_and_hooks(result["measure"]["serial_log"])
        assert launches[0] > hooks[-1]


def test_bytes_per_step_equal_stage2_theory(trained) -> None:
    world_size, results = trained
    for result in results:
        m = result["measure"]
        padded = sum(m["flat_numels"]) * 4
        stats = m["stats"]
        print(
            f"world_size={world_size}: reduce_scatter {stats['reduce_scatter_bytes']} B, "
            f"all_gather {stats['all_gather_bytes']} B, flag all_reduce "
            f"{stats['all_reduce_bytes']} B; theory 2 x {padded} B (padded flat size, "
            f"{sum(m['param_numels']) * 4} B unpadded) + {(m['num_params'] + 4) * 4} B flags"
        )
        assert stats["reduce_scatter_bytes"] == padded
        assert stats["all_gather_bytes"] == padded
        # One int32 flag per parameter (had a gradient), the overflow flag,
        # the detached-parameter flag, the hyper-parameters' hash and its
        # complement; and this first step only, a broadcast of the buckets'
        # launch order (rank 0's, two int64 per bucket over the host channel).
        order = [e for e in m["log"] if e[0] == "launch" and e[3] == "bucket_order"]
        buckets = sum(1 for e in m["log"] if e[0] == "launch" and e[1] == "reduce_scatter")
        assert [(e[1], e[2]) for e in order] == [("broadcast", 16 * buckets)], order
        assert stats["all_reduce_bytes"] == (m["num_params"] + 4) * 4
        assert stats["broadcast_bytes"] == 16 * buckets


def _train_with_collectives(rank: int, world_size: int, stage: int, broadcasts: bool, a2a: bool):
    model = make_model(seed=0)
    stage3 = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(
        param_groups(model, _LRS["adamw"]),
        "adamw",
        stage=stage,
        weight_decay=0.1,
        reduce_bucket_size=BUCKET,
        gloo_all_gather_broadcasts=broadcasts,
        gloo_reduce_scatter_all_to_all=a2a,
        **stage3,
    )
    train(model, optimizer, STEPS, rank, world_size)
    with optimizer.gathered_parameters():
        return snapshot(model)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gloo_collective_choices_give_the_same_parameters(stage: int) -> None:
    """Gloo's collectives as zeroshard issues them, against Gloo's own.

    The all-gather as one in-place broadcast per rank (the default) moves the
    same values as Gloo's allgather, so those two runs must agree bit for bit.
    The reduce-scatter (all-to-all plus a local sum, or c10d's all-reduce
    emulation) may round differently; every choice stays within the 1e-6
    bound of single-process torch.optim, at a world size that divides nothing.
    """
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(param_groups(model, _LRS["adamw"]), weight_decay=0.1)
    train(model, optimizer, STEPS, 0, 1)
    expected = snapshot(model)
    runs = {
        (b, a): unwrap(run_ranks(3, _train_with_collectives, stage, b, a))
        for b, a in [(True, True), (False, True), (True, False)]
    }
    for rank in range(3):
        # Only the all-gather differs: the same bits.
        assert max_abs_diff(runs[(True, True)][rank], runs[(False, True)][rank]) == 0.0
        for choice, results in runs.items():
            diff = max_abs_diff(results[rank], expected)
            print(f"stage {stage} rank {rank} broadcasts/all-to-all {choice}: {diff:.2e}")
            assert diff <= TOLERANCE
