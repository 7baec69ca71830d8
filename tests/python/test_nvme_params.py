"""NVMe parameter offload (ZeRO-Infinity's parameter tier) at stage 3.

Each rank's shard of every unit's parameters lives in a swap file under
``offload_param.nvme_path`` and is read ahead of the all-gather that needs it,
in the previous iteration's order. Only where the shard is stored changes: the
values sent to the all-gathers and written back by the step are those of
``offload_param="cpu"``, so the results must equal that run bit for bit, and
torch.optim within the CPU-offload bound.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from test_offload import _max_diff, _resume, _train, reference

TOLERANCE = 1e-6  # as tests/python/test_offload.py: measured ~1e-7


def _nvme(path: Path, **extra: Any) -> dict[str, Any]:
    return {"device": "nvme", "nvme_path": str(path), **extra}


def _train_and_inspect(
    rank: int, world_size: int, kwargs: dict[str, Any], accumulation: int, dtype: torch.dtype
) -> dict[str, Any]:
    result = _train(rank, world_size, 3, kwargs, accumulation, 0.5, dtype)
    gc.collect()  # the optimizer is gone once _train returned
    stats = result["nvme_stats"]
    if stats is not None and "parameters" in stats:
        result["directory_left"] = os.path.exists(stats["parameters"]["directory"])
    return result


# name: (world size, offload_optimizer, offload_param extra keys, sub_group_size)
CASES: dict[str, tuple[int, Any, dict[str, Any], int]] = {
    # Sub-groups of 13 elements cut buckets: the step's writes patch slots.
    "optimizer_cpu": (2, "cpu", {"max_in_cpu": 0}, 13),
    "optimizer_nvme_one_buffer": (2, "nvme", {"max_in_cpu": 0, "buffer_count": 1}, 11),
    "world3": (3, "cpu", {"max_in_cpu": 0, "buffer_count": 2}, 1000),
    # Each parameter group is one bucket here, this rank's shards 79 and 50
    # elements: max_in_cpu 100 keeps the first in host memory, not the second.
    "max_in_cpu_part": (2, "cpu", {"max_in_cpu": 100}, 17),
}


def _kwargs(path: Path, optimizer: Any, param: dict[str, Any] | str, sub_group: int):
    optimizer_offload = _nvme(path / "optimizer") if optimizer == "nvme" else optimizer
    (path / "optimizer").mkdir(exist_ok=True)
    return {
        "offload_optimizer": optimizer_offload,
        "offload_param": param,
        "sub_group_size": sub_group,
        "stage3_param_persistence_threshold": 0,
    }


@pytest.mark.parametrize("name", list(CASES))
def test_nvme_parameters_match_cpu_offload_bit_for_bit_and_torch_optim(
    name: str, tmp_path: Path
) -> None:
    world_size, optimizer, param, sub_group = CASES[name]
    nvme_kwargs = _kwargs(tmp_path, optimizer, _nvme(tmp_path, **param), sub_group)
    cpu_kwargs = _kwargs(tmp_path, optimizer, "cpu", sub_group)
    nvme = unwrap(run_ranks(world_size, _train_and_inspect, nvme_kwargs, 2, torch.float32))
    cpu = unwrap(run_ranks(world_size, _train_and_inspect, cpu_kwargs, 2, torch.float32))
    expected = reference(2, 0.5)
    for rank in range(world_size):
        stats = nvme[rank]["nvme_stats"]["parameters"]
        diff = _max_diff(nvme[rank]["params"], expected)
        print(f"{name} rank {rank}: max abs diff from torch.optim {diff:.3e}; {stats}")
        assert diff <= TOLERANCE, (name, rank, diff)
        assert _max_diff(nvme[rank]["params"], cpu[rank]["params"]) == 0.0
        assert stats["disk_bytes"] > 0 and stats["bytes_written"] >= stats["disk_bytes"]
        # Every step's forward and backward gather every used unit from disk,
        # 10 steps; the step writes each slot back.
        assert stats["bytes_read"] >= 10 * stats["disk_bytes"]
        # From the second iteration on the read-ahead serves the reads it
        # foresaw. The model uses one parameter on even steps only, so the
        # plan misses at odd/even switches and some reads wait on demand.
        assert stats["reads_ahead"] > 0
        assert stats["peak_ahead_bytes"] <= param.get("buffer_count", 5) * 4096
        assert not nvme[rank]["directory_left"], "the swap directory outlived the optimizer"
    in_cpu = nvme[0]["nvme_stats"]["parameters"]["host_shard_bytes"]
    assert (in_cpu > 0) == (param["max_in_cpu"] > 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer"]
    assert list((tmp_path / "optimizer").iterdir()) == []


def test_bf16_nvme_parameters_match_cpu_offload_bit_for_bit(tmp_path: Path) -> None:
    nvme_kwargs = _kwargs(tmp_path, "nvme", _nvme(tmp_path, max_in_cpu=0), 11)
    cpu_kwargs = _kwargs(tmp_path, "nvme", "cpu", 11)
    nvme = unwrap(run_ranks(2, _train_and_inspect, nvme_kwargs, 1, torch.bfloat16))
    cpu = unwrap(run_ranks(2, _train_and_inspect, cpu_kwargs, 1, torch.bfloat16))
    for rank in range(2):
        assert nvme[rank]["params"][0].dtype == torch.bfloat16
        assert _max_diff(nvme[rank]["params"], cpu[rank]["params"]) == 0.0
    # full_parameters gathers the fp32 master on rank 0.
    assert _max_diff(nvme[0]["master"], cpu[0]["master"]) == 0.0
    # The bf16 shards on disk are the rounded fp32 master.
    for master, param in zip(nvme[0]["master"], nvme[0]["params"], strict=True):
        assert torch.equal(master.to(torch.bfloat16), param)


def test_nvme_parameters_save_load_continue_equals_uninterrupted(tmp_path: Path) -> None:
    kwargs = _kwargs(tmp_path, "cpu", _nvme(tmp_path, max_in_cpu=0), 11)
    diffs = unwrap(run_ranks(2, _resume, 3, kwargs))
    print(f"NVMe parameters: resumed vs uninterrupted max abs diff {diffs[0]:.3e}")
    assert diffs[0] == 0.0, "resuming replays the same arithmetic"


# ---- Resident memory: buffer_count buckets, whatever the model size ------------------

WIDTH = 64
BUFFERS = 2


def _on_nvme(model: nn.Module, path: str, **nvme: Any) -> Any:
    """Stage 3, optimizer state on the host, every parameter shard on NVMe."""
    return zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=3,
        module=model,
        offload_optimizer="cpu",
        offload_param=_nvme(Path(path), **nvme),
        stage3_param_persistence_threshold=0,
    )


def _resident(rank: int, world_size: int, path: str) -> list[dict[str, int]]:
    out = []
    for depth in (2, 8):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(depth)))
        optimizer = _on_nvme(model, path, buffer_count=BUFFERS, max_in_cpu=0)
        warm: dict[str, int] = {}
        for step in range(4):
            if step == 2:
                warm = dict(optimizer.nvme_stats()["parameters"])
            optimizer.zero_grad()
            model(torch.randn(4, WIDTH)).pow(2).mean().backward()
            optimizer.step()
        stats = optimizer.nvme_stats()["parameters"]
        out.append(
            {
                "params": sum(p.numel() for p in model.parameters()),
                **stats,
                "late_ahead": stats["reads_ahead"] - warm["reads_ahead"],
                "late_on_demand": stats["reads_on_demand"] - warm["reads_on_demand"],
            }
        )
        del optimizer
    return out


def test_resident_parameter_shards_are_buffer_count_buckets_whatever_the_model_size(
    tmp_path: Path,
) -> None:
    for rows in unwrap(run_ranks(2, _resident, str(tmp_path))):
        small, large = rows
        print(f"parameter swap: {small} vs {large}")
        # One layer per unit: its shard is (64 * 64 + 64) / 2 fp32 elements,
        # 8,320 bytes, a slot of 12 KiB.
        slot = -(-(WIDTH * WIDTH + WIDTH) // 2 * 4 // 4096) * 4096
        assert small["disk_bytes"] == 2 * slot and large["disk_bytes"] == 8 * slot
        assert small["host_shard_bytes"] == large["host_shard_bytes"] == 0
        assert small["peak_ahead_bytes"] == large["peak_ahead_bytes"] == BUFFERS * slot
        # The first iteration has no plan, the second gathers in another order
        # (the gatherer's own prefetch starts); from then on the order repeats
        # and every read is served by the read-ahead.
        for row in rows:
            assert row["late_on_demand"] == 0 and row["late_ahead"] >= 2 * row["disk_bytes"] // slot


# ---- Faults ---------------------------------------------------------------------------


def _two_units_on_nvme(path: str) -> tuple[nn.Module, Any, str]:
    """Two one-layer units, every shard on NVMe; the swap file's path."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    optimizer = _on_nvme(model, path, max_in_cpu=0)
    directory = optimizer.nvme_stats()["parameters"]["directory"]
    return model, optimizer, os.path.join(directory, "parameters.swap")


def _damaged(rank: int, world_size: int, path: str) -> str:
    model, optimizer, swap = _two_units_on_nvme(path)
    os.truncate(swap, 0)
    try:
        model(torch.randn(4, WIDTH)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_damaged_parameter_swap_file_is_an_error_naming_it(tmp_path: Path) -> None:
    for rank, message in enumerate(run_ranks(2, _damaged, str(tmp_path))):
        print(f"rank {rank}: {message}")
        assert "parameters.swap" in message and "met the end of the file" in message


def _modified_on_a_full_disk(rank: int, world_size: int, path: str) -> str:
    """GatheredParameters(modifier_rank=0) with rank 0's swap file on /dev/full."""
    model, optimizer, swap = _two_units_on_nvme(path)
    if rank == 0:
        # Every descriptor of the open swap file now writes to /dev/full
        # (ENOSPC), as a disk that fills up would; reads give zeros.
        full = os.open("/dev/full", os.O_RDWR)
        replaced = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target == swap:
                os.dup2(full, int(fd))
                replaced += 1
        assert replaced > 0, "the swap file is kept open"
    try:
        with optimizer.gathered_parameters(modifier_rank=0), torch.no_grad():
            for p in model.parameters():  # two units: a broadcast and a write each
                p.fill_(0.5)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_failed_write_of_modified_parameters_is_an_error_on_every_rank(tmp_path: Path) -> None:
    # Rank 0 fails its first unit's write; it goes on with the broadcasts
    # (rank 1 would otherwise wait in the second until the timeout) and both
    # raise rank 0's error after the last.
    for rank, message in enumerate(run_ranks(2, _modified_on_a_full_disk, str(tmp_path))):
        print(f"rank {rank}: {message}")
        assert "could not write the modified parameters to the NVMe swap space" in message
        assert "parameters.swap" in message, message


def _construct(rank: int, world_size: int, kwargs: dict[str, Any]) -> str:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH))
    try:
        zeroshard.ZeroOptimizer(model.parameters(), "adamw", stage=3, module=model, **kwargs)
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "no error"


def test_bad_parameter_offload_settings_fail_on_every_rank(tmp_path: Path) -> None:
    cases = {
        "no_optimizer_offload": (
            {"offload_param": _nvme(tmp_path)},
            "offload_param.device = 'nvme' needs offload_optimizer.device = 'cpu' or 'nvme'",
        ),
        "missing_path": (
            {"offload_optimizer": "cpu", "offload_param": _nvme(tmp_path / "nowhere")},
            "is not an existing directory",
        ),
        "buffer_too_small": (
            {
                "offload_optimizer": "cpu",
                "offload_param": _nvme(tmp_path, buffer_size=100, max_in_cpu=0),
                "stage3_param_persistence_threshold": 0,
            },
            "offload_param.buffer_size (100 elements) is smaller than this rank's shard",
        ),
    }
    for label, (kwargs, expected) in cases.items():
        for rank, message in enumerate(run_ranks(2, _construct, kwargs)):
            print(f"{label} rank {rank}: {message}")
            assert expected in message, (label, rank, message)
    assert list(tmp_path.iterdir()) == [], "a failed construction left swap files behind"


# ---- The engine reads DeepSpeed's ZeRO-Infinity config as written ---------------------


def _engine_run(
    rank: int, world_size: int, offload_param: dict[str, Any], telemetry: str
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 2,
        "zeroshard": {"telemetry_file": telemetry},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": offload_param,
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, optimizer, *_ = zeroshard.initialize(model, config=config)
    before = optimizer.nvme_stats()
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 24, generator=g)[2 * rank : 2 * rank + 2]
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    after = optimizer.nvme_stats()  # at the last telemetry line (step 4)
    with optimizer.gathered_parameters():
        params = [p.detach().clone() for p in model.parameters()]
    moved = None
    if after is not None:
        moved = {
            key: after["parameters"][key] - before["parameters"][key]
            for key in ("bytes_read", "bytes_written")
        }
    return {"params": params, "stats": optimizer.nvme_stats(), "moved": moved}


def test_engine_runs_deepspeeds_nvme_param_section_as_cpu_offload_does(tmp_path: Path) -> None:
    section = _nvme(tmp_path, buffer_count=5, buffer_size=100_000_000, max_in_cpu=0)
    telemetry = tmp_path / "telemetry.jsonl"
    nvme = unwrap(run_ranks(2, _engine_run, section, str(telemetry)))
    cpu = unwrap(run_ranks(2, _engine_run, {"device": "cpu"}, str(tmp_path / "cpu.jsonl")))
    for rank in range(2):
        stats = nvme[rank]["stats"]["parameters"]
        print(f"rank {rank}: {stats}")
        assert stats["bytes_written"] > 0 and stats["reads_ahead"] > 0
        assert cpu[rank]["stats"] is None
        assert _max_diff(nvme[rank]["params"], cpu[rank]["params"]) == 0.0
    # Rank 0's telemetry: per-step NVMe bytes over two lines of two steps each
    # add up to what the swap space counted over the four steps. Writes are
    # waited for within the step; the reads the step starts for the next
    # iteration (at most buffer_count slots of 4 KiB) may complete after the
    # last line.
    lines = [json.loads(line) for line in telemetry.read_text().splitlines()]
    print(lines)
    assert [line["step"] for line in lines] == [2, 4]
    moved = nvme[0]["moved"]
    assert sum(2 * line["nvme_written_bytes"] for line in lines) == moved["bytes_written"]
    read = sum(2 * line["nvme_read_bytes"] for line in lines)
    assert 0 < read <= moved["bytes_read"] <= read + 5 * 4096
    for line in lines:
        assert 0 <= line["nvme_wait_share"] <= 1 and line["nvme_gb_per_s"] > 0
    assert "nvme_read_bytes" not in (tmp_path / "cpu.jsonl").read_text()
