"""Step time of zeroshard against its peers, paired step by step in one run.

    python benchmarks/bench_paired.py                       # ~30M-parameter GPT
    python benchmarks/bench_paired.py --steps 40 --variants ddp_adamw,zeroshard_stage2

This machine's speed drifts by ±15% between the variants of
run_benchmarks.py, which runs each variant in processes of its own (so that
its peak RSS is its own). That drift hides differences of a few percent. Here
every variant lives in the same rank processes and they take turns: each
step, every variant trains one step on the same batch, in an order that
rotates from step to step, so a slow second of the machine falls on all of
them alike. Reported per variant: the median over steps of its step time
divided by the baseline's step time in the same step, with the 25th and 75th
percentiles of that ratio, and the median time of each phase (forward,
backward, optimizer step) on rank 0. A step's time runs from a barrier to a
barrier, so it is the slowest rank's. Memory is run_benchmarks.py's business.
Results: <out>.md and <out>.json (every round's figures, rank 0), by default
benchmarks/results/paired; the kept runs are listed in benchmarks/results/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_benchmarks import ROOT, Variant, add_run_arguments  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from dist_harness import run_ranks  # noqa: E402

DEFAULT_VARIANTS = [
    "ddp_adamw",
    "zeroshard_stage1",
    "zeroshard_stage1_overlap",
    "zeroshard_stage2",
    "zeroshard_stage2_fused",
    "fsdp2",
    "zeroshard_stage3",
    "zeroshard_stage3_nowindow",
]


def baseline_of(name: str) -> str:
    """The peer each variant's step time is compared with: DDP + torch Muon for
    the Muon variants, DDP + the same class for a torch.optim class's
    (``_radam``, ``_adafactor``), FSDP2 for stage 3, else DDP + AdamW."""
    if name.endswith("_muon"):
        return "ddp_muon"
    for suffix in ("_radam", "_adafactor"):  # a torch.optim class: DDP + the same class
        if name.endswith(suffix):
            return "ddp" + suffix
    return "fsdp2" if name.startswith(("zeroshard_stage3", "fsdp2")) else "ddp_adamw"


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from train_gpt import GPT

    torch.set_num_threads(max(1, args.threads))
    variants = {}
    for name in args.variants:
        torch.manual_seed(0)
        model = GPT(args.vocab, args.width, args.depth, args.heads, args.context)
        variants[name] = Variant(name, model, args)
    phases: dict[str, dict[str, list[float]]] = {
        name: {"step": [], "forward": [], "backward": [], "optimizer": []} for name in variants
    }
    # Minor page faults of this process per phase: memory mapped or touched
    # afresh (a buffer unmapped and mapped again faults its pages in again).
    faults: dict[str, dict[str, list[int]]] = {
        name: {"forward": [], "backward": [], "optimizer": []} for name in variants
    }

    def minor_faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    per_rank = args.global_batch // world
    names = list(variants)
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, args.vocab, (args.global_batch, args.context + 1), generator=g)
        seq = seq[rank * per_rank : (rank + 1) * per_rank]
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            variant = variants[name]
            dist.barrier()
            start = time.perf_counter()
            faults_at_start = minor_faults()
            variant.zero_grad()
            logits = variant.model(seq[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, args.vocab), seq[:, 1:].reshape(-1)
            )
            forward = time.perf_counter()
            faults_at_forward = minor_faults()
            variant.backward(loss)
            backward = time.perf_counter()
            faults_at_backward = minor_faults()
            variant.step()
            optimizer = time.perf_counter()
            faults_at_optimizer = minor_faults()
            dist.barrier()
            end = time.perf_counter()
            if step >= args.warmup:
                times = phases[name]
                times["step"].append(end - start)
                times["forward"].append(forward - start)
                times["backward"].append(backward - forward)
                times["optimizer"].append(optimizer - backward)
                counts = faults[name]
                counts["forward"].append(faults_at_forward - faults_at_start)
                counts["backward"].append(faults_at_backward - faults_at_forward)
                counts["optimizer"].append(faults_at_optimizer - faults_at_backward)
    dist.barrier()
    del variants  # before the process group goes
    return {"phases": phases, "faults": faults}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser, steps=30, warmup=3)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "paired"))
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    results = run_ranks(args.world_size, _rank, args, timeout=7200)
    rank0 = results[0]["phases"]
    faults0 = results[0]["faults"]
    lines = [
        "# Step time, paired step by step (zeroshard and its peers in one run)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
        f"Gloo on CPU, {args.world_size} ranks, {args.threads} thread(s) per rank",
        f"- model: examples/train_gpt.py's GPT (vocab {args.vocab}, width {args.width}, depth "
        f"{args.depth}), global batch {args.global_batch} x {args.context} tokens; "
        f"{args.steps} timed steps after {args.warmup} warm-up",
        "- every variant trains one step per round in the same processes, in a rotating order; "
        "ratio = this variant's step time / its baseline's in the same round (median and "
        "25th-75th percentile over rounds); phases are rank 0's medians; page faults are rank "
        "0's minor faults per phase (forward / backward / optimizer step), median over rounds",
        "",
        "| variant | baseline | ratio (median) | ratio p25-p75 | step (ms) | forward (ms) | "
        "backward (ms) | optimizer step (ms) | page faults (fwd / bwd / step) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.variants:
        baseline = baseline_of(name)
        if baseline not in rank0 or not name.startswith("zeroshard"):
            baseline = name
        ratios = [a / b for a, b in zip(rank0[name]["step"], rank0[baseline]["step"], strict=True)]
        medians = {k: statistics.median(v) * 1e3 for k, v in rank0[name].items()}
        lines.append(
            f"| {name} | {baseline} | {statistics.median(ratios):.3f} | "
            f"{quantile(ratios, 0.25):.3f}-{quantile(ratios, 0.75):.3f} | "
            f"{medians['step']:.1f} | {medians['forward']:.1f} | {medians['backward']:.1f} | "
            f"{medians['optimizer']:.1f} | "
            + " / ".join(f"{statistics.median(faults0[name][k]):.0f}" for k in faults0[name])
            + " |"
        )
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    # Every round's figures (rank 0), for looking at a spread rather than its summary.
    with open(args.out + ".json", "w") as f:
        json.dump({"variants": args.variants, "phases": rank0, "faults": faults0}, f)
    print(text)


if __name__ == "__main__":
    main()
