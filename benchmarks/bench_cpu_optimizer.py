"""CPU optimizer micro-benchmark: time per parameter of one AdamW step.

    python benchmarks/bench_cpu_optimizer.py --numel 4000000

Compares zeroshard's inner AdamW (the update every rank runs on its shard,
and the slot the CPU-offload Adam will fill) with torch.optim.AdamW in its
CPU default (single-tensor), foreach and fused forms, on the same tensors,
in one run. Also prints the roofline: an fp32 Adam step moves about 28 bytes
per parameter (read p, g, m, v; write p, m, v). Results:
benchmarks/results/cpu_optimizer.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from zeroshard import _C  # noqa: E402


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(numel: int, repeats: int, device: str) -> float:
    """Bytes per second of a large tensor copy (read + write), the memory roofline."""
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    return 2 * 4 * numel / median_seconds(lambda: dst.copy_(src), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_optimizer.md")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.numel
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

    device = args.device
    param, grad = torch.randn(n, device=device), torch.randn(n, device=device)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    step = [0]

    def zeroshard_adamw() -> None:
        step[0] += 1
        _C.inner_update("adamw", hyper, param, grad, m, v, torch.Tensor(), step[0])

    def zeroshard_adamw_fused() -> None:
        step[0] += 1
        _C.inner_update("adamw", hyper, param, grad, m, v, torch.Tensor(), step[0], fused=True)

    results = {
        "zeroshard inner AdamW": median_seconds(zeroshard_adamw, args.repeats),
        "zeroshard inner AdamW fused=True": median_seconds(zeroshard_adamw_fused, args.repeats),
    }
    for label, kwargs in (
        ("torch AdamW (CPU default)", {"foreach": False}),
        ("torch AdamW foreach=True", {"foreach": True}),
        ("torch AdamW fused=True", {"fused": True}),
    ):
        p = torch.nn.Parameter(torch.randn(n, device=device))
        p.grad = torch.randn(n, device=device)
        optimizer = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kwargs)
        results[label] = median_seconds(optimizer.step, args.repeats)
    bandwidth = copy_bandwidth(n, args.repeats, device)
    roofline = 28 * n / bandwidth
    base = results["torch AdamW (CPU default)"]
    lines = [
        f"# {device.upper()} optimizer micro-benchmark (one AdamW step, fp32)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, {args.threads} thread(s); "
        f"torch {torch.__version__}",
        f"- {n:,} parameters; median of {args.repeats} steps; roofline = 28 bytes/parameter at "
        f"the measured copy bandwidth {bandwidth / 1e9:.1f} GB/s = {roofline * 1e3:.2f} ms",
        "",
        "| implementation | step (ms) | ns / parameter | speed vs torch default "
        "| time / roofline |",
        "|---|---|---|---|---|",
    ]
    for label, seconds in results.items():
        lines.append(
            f"| {label} | {seconds * 1e3:.2f} | {seconds / n * 1e9:.2f} | "
            f"{base / seconds:.2f}x | {seconds / roofline:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
