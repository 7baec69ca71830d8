"""NVMe optimizer offload: the swap bandwidth a step achieves against the disk's own.

    python benchmarks/bench_nvme.py --params 100M --nvme-path /var/tmp

One run, one machine:

1. The disk under ``--nvme-path``: sequential O_DIRECT write and read
   bandwidth measured by fio (1 MiB blocks, queue depth 32, io_uring), the
   ceiling any swap can reach.
2. zeroshard, stage 3 on one Gloo rank, AdamW with ``offload_optimizer``
   on NVMe (``sub_group_size`` elements per sub-group, ``buffer_count`` 4):
   the optimizer step's wall time, the bytes it read and wrote, the time it
   waited for I/O, and its I/O efficiency: the time the disk needs for those
   bytes at fio's bandwidths divided by the step's time (1.0: the step runs at
   the disk's speed; the issue's target is >= 0.8).
3. DeepSpeed 0.19, stage 3 (its only stage with NVMe offload) with the same
   ``offload_optimizer`` section, when it runs on this CPU machine (the swap
   files it writes under ``--nvme-path`` are checked); otherwise its error.

Results: results/nvme.md (the numbers of the run that wrote it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


def parse_count(text: str) -> int:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].isalpha() else int(text)


def fio_bandwidth(path: str, size: str) -> dict[str, Any]:
    """Sequential O_DIRECT write, read, and both at once (half each) of one
    file, GB/s (1e9 bytes)."""
    if shutil.which("fio") is None:
        return {"error": "fio not installed (apt-get install fio)"}
    target = os.path.join(path, "zeroshard-fio.bin")
    out: dict[str, Any] = {}
    try:
        for mode in ("write", "read", "rw"):
            done = subprocess.run(
                [
                    "fio",
                    "--name=seq",
                    f"--filename={target}",
                    f"--rw={mode}",
                    "--bs=1M",
                    "--iodepth=32",
                    "--ioengine=io_uring",
                    "--direct=1",
                    f"--size={size}",
                    "--time_based",
                    "--runtime=6",
                    "--output-format=json",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            job = json.loads(done.stdout)["jobs"][0]
            if mode == "rw":  # reads and writes at once: their sum
                out[mode] = (job["read"]["bw_bytes"] + job["write"]["bw_bytes"]) / 1e9
            else:
                out[mode] = job[mode]["bw_bytes"] / 1e9
    except (subprocess.CalledProcessError, KeyError, json.JSONDecodeError) as error:
        out["error"] = str(error)
    finally:
        if os.path.exists(target):
            os.remove(target)
    return out


class Wide(nn.Module):
    """Square layers totalling about ``params`` parameters."""

    def __init__(self, params: int, width: int = 2048) -> None:
        super().__init__()
        layers = max(1, params // (width * width + width))
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _init_single_rank(tmp: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=600),
    )


def _io(stats: dict[str, Any]) -> tuple[int, int, float]:
    """Bytes read, written and I/O wait of every swap space (state, gradients)."""
    spaces = [stats] + ([stats["gradients"]] if "gradients" in stats else [])
    return (
        sum(s["bytes_read"] for s in spaces),
        sum(s["bytes_written"] for s in spaces),
        sum(s["io_wait_seconds"] for s in spaces),
    )


def run_zeroshard(
    args: argparse.Namespace, model: nn.Module, swap_gradients: bool = False
) -> dict[str, Any]:
    import zeroshard

    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=3,
        module=model,
        lr=1e-4,
        offload_optimizer={
            "device": "nvme",
            "nvme_path": args.nvme_path,
            "buffer_count": args.buffer_count,
            "swap_gradients": swap_gradients,
        },
        sub_group_size=args.sub_group_size,
        aio={"queue_depth": 32, "block_size": 1 << 20},
    )
    x = torch.randn(1, 2048)
    times, backward_times, moved = [], [], []
    for _ in range(args.steps):
        optimizer.zero_grad()
        start = time.perf_counter()
        model(x).sum().backward()  # with swap_gradients, writes the gradient shard
        backward_times.append(time.perf_counter() - start)
        before = _io(optimizer.nvme_stats())
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
        after = _io(optimizer.nvme_stats())
        moved.append(tuple(a - b for a, b in zip(after, before, strict=True)))
    stats = optimizer.nvme_stats()
    # The first step also pays page faults of the fresh buffers: the rest.
    keep = slice(1, None) if args.steps > 1 else slice(None)
    step = sorted(times[keep])[len(times[keep]) // 2]
    backward = sorted(backward_times[keep])[len(backward_times[keep]) // 2]
    read, written, wait = (
        sorted(m[i] for m in moved[keep])[len(moved[keep]) // 2] for i in range(3)
    )
    del optimizer
    return {
        "backend": stats["backend"],
        "backward_seconds": backward,
        "gradient_disk_bytes": stats.get("gradients", {}).get("disk_bytes", 0),
        "step_seconds": step,
        "read_bytes": read,
        "written_bytes": written,
        "io_wait_seconds": wait,
        "buffer_bytes": stats["buffer_bytes"],
        "disk_bytes": stats["disk_bytes"],
    }


def _bytes_under(path: str) -> int:
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(directory, name))
            except OSError:
                pass
    return total


def run_deepspeed(
    args: argparse.Namespace, model: nn.Module, swap: str, pipeline: bool
) -> dict[str, Any]:
    try:
        import deepspeed
    except Exception as error:  # noqa: BLE001 - reported in the table
        return {"error": f"import deepspeed: {error}"}
    # What torchrun would set for this single rank.
    os.environ.update({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"})
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": swap,
                "buffer_count": args.buffer_count,
                "pipeline_read": pipeline,
                "pipeline_write": pipeline,
            },
            "sub_group_size": args.sub_group_size,
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32},
    }
    try:
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        x = torch.randn(1, 2048)
        times = []
        swap_bytes = 0
        for _ in range(args.steps):
            loss = engine(x).sum()
            engine.backward(loss)
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            swap_bytes = max(swap_bytes, _bytes_under(swap))
        if swap_bytes == 0:
            return {"error": "it wrote no swap file under nvme_path (not NVMe offload)"}
        steady = times[1:] or times
        return {"step_seconds": sorted(steady)[len(steady) // 2], "swap_bytes": swap_bytes}
    except Exception as error:  # noqa: BLE001 - reported in the table
        from capacity_deepspeed import describe_error

        return {"error": describe_error(error)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="100M")
    parser.add_argument("--nvme-path", default="/var/tmp")
    parser.add_argument("--sub-group-size", type=int, default=4_000_000)
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fio-size", default="2G")
    parser.add_argument("--skip-deepspeed", action="store_true")
    parser.add_argument(
        "--swap-gradients",
        action="store_true",
        help="also run zeroshard with offload_optimizer.swap_gradients (a row of its own)",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "nvme.md"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    disk = fio_bandwidth(args.nvme_path, args.fio_size)
    print(f"disk: {disk}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        _init_single_rank(tmp)
        torch.manual_seed(0)
        model = Wide(parse_count(args.params))
        n_params = sum(p.numel() for p in model.parameters())
        ours = run_zeroshard(args, model)
        del model
        print(f"zeroshard: {ours}", flush=True)
        swapped = None
        if args.swap_gradients:
            # A fresh model: the first run's stage-3 optimizer kept it partitioned.
            torch.manual_seed(0)
            swapped = run_zeroshard(args, Wide(parse_count(args.params)), swap_gradients=True)
            print(f"zeroshard, swap_gradients: {swapped}", flush=True)
        # DeepSpeed pipelined as zeroshard is, and with its own defaults (no pipelining).
        peers: dict[str, dict[str, Any]] = {}
        for label, pipeline in (("pipelined", True), ("defaults", False)):
            if args.skip_deepspeed:
                peers[label] = {"error": "skipped (--skip-deepspeed)"}
                continue
            torch.manual_seed(0)
            swap = tempfile.mkdtemp(prefix="deepspeed-swap-", dir=args.nvme_path)
            try:
                peers[label] = run_deepspeed(args, Wide(parse_count(args.params)), swap, pipeline)
            finally:
                shutil.rmtree(swap, ignore_errors=True)
            print(f"deepspeed ({label}): {peers[label]}", flush=True)
        dist.destroy_process_group()

    lines = [
        "# NVMe optimizer offload: swap bandwidth against the disk",
        "",
        f"`python benchmarks/bench_nvme.py --params {args.params} --nvme-path {args.nvme_path}`"
        f" on {platform.node() or 'this machine'} ({os.cpu_count()} cores), torch "
        f"{torch.__version__}; {n_params / 1e6:.1f}M fp32 parameters, AdamW, stage 3 on one "
        f"Gloo rank, sub_group_size {args.sub_group_size:,}, buffer_count {args.buffer_count}; "
        f"median of steps 2-{args.steps}.",
        "",
    ]
    if "error" in disk:
        lines += [f"Disk bandwidth: not measured ({disk['error']}).", ""]
    else:
        lines += [
            f"Disk (fio, O_DIRECT, 1 MiB, queue depth 32, io_uring): write "
            f"{disk['write']:.2f} GB/s, read {disk['read']:.2f} GB/s, both at once "
            f"{disk['rw']:.2f} GB/s (sum).",
            "",
        ]
    lines += [
        "| | backward (s) | step (s) | read (GB) | written (GB) | I/O wait (s) | swap GB/s "
        "| I/O efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = [(f"zeroshard ({ours['backend']})", ours)]
    if swapped is not None:
        rows.append((f"zeroshard ({swapped['backend']}), swap_gradients", swapped))
    for name, run in rows:
        moved = run["read_bytes"] + run["written_bytes"]
        efficiency = "n/a"
        if "error" not in disk:
            # The step reads ahead while it writes behind: both at once.
            efficiency = f"{moved / (disk['rw'] * 1e9) / run['step_seconds']:.2f}"
        lines.append(
            f"| {name} | {run['backward_seconds']:.2f} | {run['step_seconds']:.2f} | "
            f"{run['read_bytes'] / 1e9:.2f} | {run['written_bytes'] / 1e9:.2f} | "
            f"{run['io_wait_seconds']:.2f} | {moved / 1e9 / run['step_seconds']:.2f} | "
            f"{efficiency} |"
        )
    for label, theirs in peers.items():
        name = f"DeepSpeed 0.19, pipeline_read/write {'on' if label == 'pipelined' else 'off'}"
        if "error" in theirs:
            lines.append(f"| {name} | | error: {theirs['error']} | | | | | |")
        else:
            lines.append(
                f"| {name} (swap files {theirs['swap_bytes'] / 1e9:.2f} GB) | | "
                f"{theirs['step_seconds']:.2f} | | | | | |"
            )
    lines += [
        "",
        f"Host buffers {ours['buffer_bytes'] / 1e6:.0f} MB for {ours['disk_bytes'] / 1e9:.2f} GB "
        "of optimizer state on disk. I/O efficiency: the bytes the step moved per second over "
        "fio's bandwidth with reads and writes at once. Step columns count the step alone "
        "(with swap_gradients, its reads of the gradient shard too); backward includes the "
        "gradient shard's writes.",
        "",
    ]
    if swapped is not None:
        lines += [
            f"swap_gradients: the fp32 gradient shard ({swapped['gradient_disk_bytes'] / 1e6:.0f} "
            "MB) on disk instead of in host memory; backward "
            f"{swapped['backward_seconds'] / ours['backward_seconds']:.2f}x and step "
            f"{swapped['step_seconds'] / ours['step_seconds']:.2f}x the run with the shard in RAM.",
            "",
        ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
