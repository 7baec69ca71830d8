"""The host buffers a step keeps for the next one can be given back on demand.

Gradient staging, reduce-scatter outputs and the all-to-all's receive rows
come from a pool that holds freed mappings between steps (their pages would
otherwise fault in again every step), and so does stage 1's gradient shard,
freed at the end of each step but kept for the next one.
``release_cached_buffers`` unmaps them,
as ``torch.cuda.empty_cache`` empties CUDA's cache: the resident memory (RSS,
what the machine runs out of) must drop by what it reports, and training
afterwards must be exactly what it would have been.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import SEQ, VOCAB, make_gpt

STEPS = 6
BATCH = 4


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _train(rank: int, stage: int, release_at: int | None) -> dict[str, Any]:
    model = make_gpt(seed=0, width=64, hidden=256, layers=2)
    # 1 MB buckets: above the size from which buffers are mappings of their own.
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), stage=stage, lr=1e-3, reduce_bucket_size=250_000
    )
    generator = torch.Generator().manual_seed(rank)
    figures: dict[str, int] = {}
    for step in range(STEPS):
        if step == release_at:
            figures["cached"] = optimizer.cached_buffer_bytes()
            before = _rss_bytes()
            figures["released"] = optimizer.release_cached_buffers()
            figures["rss_drop"] = before - _rss_bytes()
            figures["cached_after"] = optimizer.cached_buffer_bytes()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        ).backward()
        optimizer.step()
    figures["cached_at_end"] = optimizer.cached_buffer_bytes()
    return {"figures": figures, "params": [p.detach().clone() for p in model.parameters()]}


def _both(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    return {"released": _train(rank, stage, STEPS // 2), "kept": _train(rank, stage, None)}


@pytest.mark.parametrize("stage", [1, 2])
def test_released_buffers_leave_the_process_and_training_is_unchanged(stage: int) -> None:
    for rank, result in enumerate(unwrap(run_ranks(2, _both, stage))):
        figures = result["released"]["figures"]
        print(
            f"stage {stage} rank {rank}: cached {figures['cached'] / 2**20:.2f} MiB, released "
            f"{figures['released'] / 2**20:.2f} MiB, RSS dropped {figures['rss_drop'] / 2**20:.2f}"
            f" MiB; cached again after {STEPS - STEPS // 2} steps: "
            f"{figures['cached_at_end'] / 2**20:.2f} MiB"
        )
        assert figures["cached"] > 0, "a step leaves its buffers in the pool"
        assert figures["released"] == figures["cached"]
        assert figures["cached_after"] == 0
        # Unmapped pages leave the process at once, whatever glibc's thresholds.
        assert figures["rss_drop"] >= 0.9 * figures["released"], figures
        assert figures["cached_at_end"] > 0, "the next steps map and pool afresh"
        for released, kept in zip(
            result["released"]["params"], result["kept"]["params"], strict=True
        ):
            assert torch.equal(released, kept)


def _stage1_shard(rank: int, world_size: int) -> dict[str, Any]:
    # 20 layers of 40K elements and buckets of 50K: every staging buffer is
    # below the size from which buffers are mappings, so the shard (~1.6 MB a
    # rank) is the one thing the pools can hold.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(199, 199) for _ in range(20)])
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), stage=1, lr=1e-3, reduce_bucket_size=50_000
    )
    numel = sum(p.numel() for p in model.parameters())
    page = os.sysconf("SC_PAGE_SIZE")
    shard_bytes = -(-(-(-numel // world_size) * 4) // page) * page
    generator = torch.Generator().manual_seed(rank)
    figures: dict[str, list[int]] = {"cached": [], "gradient_bytes": []}
    for _ in range(3):
        inputs = torch.randn(BATCH, 199, generator=generator)
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        figures["cached"].append(optimizer.cached_buffer_bytes())
        figures["gradient_bytes"].append(optimizer.gradient_bytes())
    released = optimizer.release_cached_buffers()
    return {"figures": figures, "shard_bytes": shard_bytes, "released": released}


def test_stage1_gradient_shard_is_kept_between_steps_and_released_on_demand() -> None:
    # [Note: the stage-1 shard between steps]: a fresh mapping each step
    # faulted the shard in again and made stage 1's step time swing.
    for result in unwrap(run_ranks(2, _stage1_shard)):
        figures, shard_bytes = result["figures"], result["shard_bytes"]
        print(f"stage 1 shard {shard_bytes} B; after each step {figures}")
        assert figures["gradient_bytes"] == [0, 0, 0], "the step frees the shard"
        assert figures["cached"] == [shard_bytes] * 3, "its mapping stays pooled, one of it"
        assert result["released"] == shard_bytes
