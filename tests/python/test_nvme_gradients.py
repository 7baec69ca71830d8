"""Gradient shards on NVMe (``offload_optimizer.swap_gradients``).

With NVMe optimizer offload at stages 2 and 3 the fp32 gradient shard goes to
the swap space as its buckets are reduced and the step reads it back a
sub-group at a time, so host memory holds a few blocks of it instead of the
whole shard. The arithmetic is the one of a gradient shard in host memory
(fp32 sums, the same chunked norm), so fp32 results equal NVMe offload
without it exactly, and torch.optim's within the offload bound.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroshard

from dist_harness import run_ranks, unwrap
from test_nvme import RSS_BUFFERS, _engine_run, _nvme, _state_rss, _train_and_inspect
from test_offload import STEPS, _max_diff, reference

TOLERANCE = 1e-6  # as tests/python/test_offload.py

# name: (stage, kwargs without the path, micro-batches, max_norm)
CASES: dict[str, tuple[int, dict[str, Any], int, float | None]] = {
    "stage2_clip_accumulate": (2, {"sub_group_size": 11}, 2, 0.5),
    "stage3_params_on_cpu_clip_accumulate": (
        3,
        {"sub_group_size": 13, "offload_param": "cpu"},
        2,
        0.5,
    ),
    "stage3_params_on_nvme_thread_pool": (
        3,
        {"sub_group_size": 13, "offload_param": "nvme", "aio": {"use_io_uring": False}},
        1,
        None,
    ),
}


def _kwargs(path: Path, case: dict[str, Any], swap: bool) -> dict[str, Any]:
    case = dict(case)
    out: dict[str, Any] = {"sub_group_size": case.pop("sub_group_size")}
    if "aio" in case:
        out["aio"] = case.pop("aio")
    param = case.pop("offload_param", None)
    if param == "nvme":
        out["offload_param"] = _nvme(path)
    elif param is not None:
        out["offload_param"] = param
    out["offload_optimizer"] = _nvme(path, swap_gradients=swap, **case)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_swapped_gradients_match_torch_optim_and_nvme_offload_without_them(
    name: str, tmp_path: Path
) -> None:
    stage, case, accumulation, max_norm = CASES[name]
    expected = reference(accumulation, max_norm)
    runs = {}
    for swap in (False, True):
        runs[swap] = unwrap(
            run_ranks(
                2,
                _train_and_inspect,
                stage,
                _kwargs(tmp_path, case, swap),
                accumulation,
                max_norm,
                torch.float32,
            )
        )
    for rank in range(2):
        swapped, resident = runs[True][rank], runs[False][rank]
        diff = _max_diff(swapped["params"], expected)
        same = _max_diff(swapped["params"], resident["params"])
        grads = swapped["stats"]["gradients"]
        print(
            f"{name} rank {rank}: vs torch.optim {diff:.3e}, vs NVMe offload with the shard "
            f"in RAM {same:.3e}; gradient swap {grads}"
        )
        assert diff <= TOLERANCE, (name, rank, diff)
        assert same == 0.0, "the same fp32 sums in the same order, from disk instead of RAM"
        assert "gradients" not in resident["stats"]
        # Every backward round writes the whole shard; every step reads it
        # back (and a clip reads it once more, an accumulation round too).
        assert grads["bytes_written"] >= STEPS * accumulation * grads["disk_bytes"]
        assert grads["bytes_read"] >= STEPS * grads["disk_bytes"]
        # The shard left host memory: what stays are the blocks the swap
        # keeps for the next round (the shard is tiny here; see the memory
        # tests below for sizes where that matters).
        assert swapped["host_gradient_bytes"] == grads["buffer_bytes"]
        assert 0 < resident["host_gradient_bytes"] <= grads["disk_bytes"]
        assert not swapped["directory_left"]
    assert list(tmp_path.iterdir()) == []


# ---- Host memory: a few blocks, whatever the model size --------------------------------


def _gradient_host_bytes(rank: int, world_size: int, path: str) -> list[dict[str, int]]:
    out = []
    for width in (1536, 4096):  # 2.4M and 16.8M parameters: shards of 1.2M and 8.4M
        torch.manual_seed(0)
        model = torch.nn.Linear(width, width)
        optimizer = zeroshard.ZeroOptimizer(
            model.parameters(),
            "adamw",
            stage=2,
            offload_optimizer=_nvme(Path(path), buffer_count=2, swap_gradients=True),
            sub_group_size=1 << 20,
            reduce_bucket_size=1 << 20,
        )
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(4, width)).pow(2).mean().backward()
            optimizer.step()
        stats = optimizer.nvme_stats()
        grads = stats["gradients"]
        out.append(
            {
                "params": sum(p.numel() for p in model.parameters()),
                "host_gradient_bytes": optimizer.host_gradient_bytes(),
                "peak": grads["peak_buffer_bytes"],
                "disk": grads["disk_bytes"],
                "host": optimizer.host_model_state_bytes(),
                "all_disk": stats["disk_bytes"] + grads["disk_bytes"],
            }
        )
        del optimizer
    return out


def test_gradient_blocks_in_host_memory_do_not_grow_with_the_model(tmp_path: Path) -> None:
    block = 4 << 20  # kGradientSwapBlockElements fp32 elements
    for rank, rows in enumerate(unwrap(run_ranks(2, _gradient_host_bytes, str(tmp_path)))):
        small, large = rows
        print(f"rank {rank}: {small} vs {large}")
        assert large["disk"] >= 3.9 * small["disk"], "the shard on disk grows with the model"
        for row in rows:
            # At rest: the pool (buffer_count blocks at most). At the peak:
            # the blocks cut by a bucket still in flight, plus buffer_count
            # writes draining; at the larger size, not the 8.4M-element
            # (32 MiB) shard.
            assert row["host_gradient_bytes"] <= 2 * block
            assert row["peak"] <= 4 * block
            # The estimator predicts host memory and disk (4 KiB rounding of
            # each slot and region aside).
            estimate = zeroshard.estimate(
                row["params"],
                world_size=2,
                precision="fp32",
                stages=(2,),
                offload_optimizer="nvme",
                sub_group_size=1 << 20,
                nvme_buffer_count=2,
                reduce_bucket_size=1 << 20,
                host_device=True,
                swap_gradients=True,
            )[0]
            for measured, estimated in (
                (row["host"], estimate["cpu_bytes_per_node"]),
                (row["all_disk"], estimate["nvme_bytes_per_node"]),
            ):
                print(f"measured {measured} B, estimated {estimated:.0f} B")
                assert abs(measured - estimated) / estimated <= 0.01


def test_rss_falls_by_the_gradient_shard(tmp_path: Path) -> None:
    # RSS, glibc as it comes: the same model and training with NVMe optimizer
    # offload, the gradient shard in RAM vs swapped. 37.8M parameters: each
    # rank's fp32 shard is 72 MiB.
    mib = 2**20
    width = 3072
    resident = unwrap(run_ranks(2, _state_rss, str(tmp_path), width))
    swapped = unwrap(run_ranks(2, _state_rss, str(tmp_path), width, True))
    for rank in range(2):
        r, s = resident[rank], swapped[rank]
        shard = 4 * r["params"] // 2
        blocks = r["host"] - s["host"]
        print(
            f"rank {rank}: RSS added, shard in RAM {r['added'] / mib:.1f} MiB, swapped "
            f"{s['added'] / mib:.1f} MiB; the shard {shard / mib:.1f} MiB, host model-state "
            f"bytes {r['host'] / mib:.1f} -> {s['host'] / mib:.1f} MiB"
        )
        # What stays: buffer_count 4 MiB blocks, and the two gradient staging
        # slots' margin for aligned reads (2 x 2048 fp32 elements).
        assert blocks == shard - RSS_BUFFERS * (4 << 20) - 2 * 2048 * 4
        # glibc's heap and the runs' own buffers vary by tens of MiB: 32 MiB slack.
        assert r["added"] - s["added"] >= shard - 32 * mib


# ---- Bad combinations: a clear error on every rank -----------------------------------


def _construct(rank: int, world_size: int, path: str, stage: int, offload: dict[str, Any]) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    try:
        zeroshard.ZeroOptimizer(model.parameters(), "adamw", stage=stage, offload_optimizer=offload)
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "no error"


def test_swap_gradients_needs_nvme_stage_2_or_3_and_ratio_1(tmp_path: Path) -> None:
    cases = {
        "cpu": (2, {"device": "cpu", "swap_gradients": True}, "needs offload_optimizer.device"),
        "stage1": (1, _nvme(tmp_path, swap_gradients=True), "needs ZeRO stage 2 or 3"),
        "ratio": (2, _nvme(tmp_path, swap_gradients=True, ratio=0.5), "needs ratio 1"),
    }
    for label, (stage, offload, expected) in cases.items():
        for rank, message in enumerate(run_ranks(2, _construct, str(tmp_path), stage, offload)):
            print(f"{label} rank {rank}: {message}")
            assert expected in message and "swap_gradients" in message, (label, message)
    assert list(tmp_path.iterdir()) == []


# ---- A damaged swap file: every rank raises, nothing hangs ---------------------------


def _damage_before_clip(rank: int, world_size: int, path: str) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=2,
        offload_optimizer=_nvme(Path(path), swap_gradients=True),
    )
    for step in range(2):
        optimizer.zero_grad()
        model(torch.ones(2, 64)).pow(2).mean().backward()
        if step == 1 and rank == 1:
            # Rank 1's gradient swap file loses its contents after backward.
            directory = optimizer.nvme_stats()["gradients"]["directory"]
            os.truncate(os.path.join(directory, "gradients.swap"), 0)
        try:
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
        except (ValueError, RuntimeError) as error:
            return str(error)
    return "no error"


def test_a_damaged_gradient_swap_file_fails_every_rank(tmp_path: Path) -> None:
    for rank, message in enumerate(run_ranks(2, _damage_before_clip, str(tmp_path))):
        print(f"rank {rank}: {message}")
        assert "could not take the gradient norm" in message, (rank, message)
        assert "rank 1" in message and "gradients.swap" in message, (rank, message)


# ---- The engine reads the key from a DeepSpeed config ----------------------------------


def test_engine_takes_swap_gradients_from_the_config(tmp_path: Path) -> None:
    swapped = unwrap(run_ranks(2, _engine_run, _nvme(tmp_path, swap_gradients=True)))
    resident = unwrap(run_ranks(2, _engine_run, _nvme(tmp_path)))
    for rank in range(2):
        grads = swapped[rank]["stats"]["gradients"]
        print(f"rank {rank}: gradient swap {grads}")
        assert grads["bytes_written"] > 0 and "gradients" not in resident[rank]["stats"]
        for a, b in zip(swapped[rank]["params"], resident[rank]["params"], strict=True):
            assert torch.equal(a, b)
