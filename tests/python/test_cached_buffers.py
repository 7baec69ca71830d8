"""The host buffers a step keeps for the next one can be given back on demand.

Gradient staging, reduce-scatter outputs and the all-to-all's receive rows
come from a pool that holds freed mappings between steps (their pages would
otherwise fault in again every step). ``release_cached_buffers`` unmaps them,
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
