"""Step time and memory of zeroshard stages against DDP + torch.optim.AdamW.

    python benchmarks/bench_stages.py --world-size 2 --steps 20

Every variant trains the same GPT (examples/train_gpt.py) on the same data
with the same ranks (CPU, Gloo), each in fresh processes so peak RSS is its
own. Reported per variant: median step time after warm-up, tracked
model-state bytes per rank (parameters + gradients held after backward +
optimizer state, from the tensors themselves), peak process RSS, and bytes
handed to collectives per step; then ratios against DDP from the same run.
Results go to benchmarks/results/stages.md.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

VARIANTS = ["ddp_adamw", "zeroshard_stage1", "zeroshard_stage2"]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _run_variant(
    rank: int, world: int, variant: str, args: argparse.Namespace, init_file: str, results: Any
) -> None:
    import zeroshard
    from train_gpt import GPT

    torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.depth, args.heads, args.context)
    counted = model
    if variant == "ddp_adamw":
        model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        stage = int(variant[-1])
        optimizer = zeroshard.ZeroOptimizer(
            model.parameters(), "adamw", stage=stage, lr=1e-3, reduce_bucket_size=args.bucket
        )
    per_rank = args.global_batch // world
    times: list[float] = []
    grad_bytes = 0
    comm_bytes = 0
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, args.vocab, (args.global_batch, args.context + 1), generator=g)
        seq = seq[rank * per_rank : (rank + 1) * per_rank]
        if step == args.warmup and variant != "ddp_adamw":
            optimizer.reset_comm_stats()
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), seq[:, 1:].reshape(-1))
        loss.backward()
        if step == args.warmup:
            if variant == "ddp_adamw":
                grad_bytes = tensor_bytes(p.grad for p in counted.parameters())
            else:
                grad_bytes = optimizer.gradient_bytes()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
    params = list(counted.parameters())
    n_params = sum(p.numel() for p in params)
    # Per-rank wire traffic of ring collectives on the buffers handed over:
    # all-reduce 2(N-1)/N x size, reduce-scatter and all-gather (N-1)/N x size.
    ring = (world - 1) / world
    if variant == "ddp_adamw":
        state_bytes = sum(
            tensor_bytes(v for v in s.values() if isinstance(v, torch.Tensor))
            for s in optimizer.state.values()
        )
        comm_bytes = n_params * 4  # DDP all-reduces every gradient once per step
        wire_bytes = 2 * ring * comm_bytes
    else:
        state_bytes = optimizer.optimizer_state_bytes()
        stats = optimizer.comm_stats()
        comm_bytes = stats["total_bytes"] // args.steps
        wire_bytes = (
            ring
            * (
                2 * stats["all_reduce_bytes"]
                + stats["reduce_scatter_bytes"]
                + stats["all_gather_bytes"]
            )
            / args.steps
        )
    out = {
        "median_step_s": statistics.median(times),
        "param_bytes": tensor_bytes(params),
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": state_bytes,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "comm_bytes_per_step": comm_bytes,
        "wire_bytes_per_step": wire_bytes,
        "n_params": n_params,
    }
    buffer = io.BytesIO()
    torch.save(out, buffer)
    results.put((rank, buffer.getvalue()))
    dist.destroy_process_group()


def run_variant(variant: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_run_variant,
                args=(r, args.world_size, variant, args, f"{tmp}/rdzv", results),
            )
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            rank, payload = results.get(timeout=1800)
            got[rank] = torch.load(io.BytesIO(payload))
        for p in procs:
            p.join()
    return [got[r] for r in range(args.world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--bucket", type=int, default=int(5e8), help="zeroshard reduce_bucket_size in elements"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "stages.md"))
    args = parser.parse_args()

    rows = {}
    for variant in args.variants.split(","):
        print(f"running {variant} ...", flush=True)
        rows[variant] = run_variant(variant, args)
    base = rows.get("ddp_adamw")
    n_params = next(iter(rows.values()))[0]["n_params"]
    lines = [
        "# zeroshard stages against DDP + torch.optim.AdamW",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
        f"Gloo on CPU, {args.world_size} ranks, {args.threads} thread(s) per rank",
        f"- model: GPT, {n_params / 1e6:.2f}M parameters (fp32), global batch "
        f"{args.global_batch} x {args.context} tokens; {args.steps} timed steps after "
        f"{args.warmup} warm-up",
        "- model-state bytes = parameters + gradients held after backward + optimizer state "
        "(rank 0, from the tensors); ratios are against DDP measured in this same run",
        "- buffers handed to collectives: DDP all-reduces the gradients once (Ψ); ZeRO-1/2 "
        "reduce-scatter them (Ψ) and all-gather the parameters (Ψ). Ring traffic per rank is "
        "the same 2Ψ(N-1)/N for both. Gloo has no native reduce-scatter: it runs an "
        "all-reduce underneath, so on CPU ZeRO moves more bytes than the ring figure.",
        "",
        "| variant | median step (ms) | step time / DDP | model states (MiB) | / DDP | "
        "gradients after backward (MiB) | optimizer state (MiB) | peak RSS (MiB) | "
        "buffers handed to collectives/step (MiB) | ring traffic/rank/step (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, ranks in rows.items():
        r0 = ranks[0]
        states = r0["param_bytes"] + r0["grad_bytes"] + r0["optimizer_state_bytes"]
        step_ms = statistics.median(r["median_step_s"] for r in ranks) * 1e3
        if base:
            b0 = base[0]
            base_states = b0["param_bytes"] + b0["grad_bytes"] + b0["optimizer_state_bytes"]
            base_ms = statistics.median(r["median_step_s"] for r in base) * 1e3
            time_ratio, mem_ratio = f"{step_ms / base_ms:.2f}", f"{states / base_states:.2f}"
        else:
            time_ratio = mem_ratio = "n/a"
        lines.append(
            f"| {variant} | {step_ms:.1f} | {time_ratio} | {states / 2**20:.2f} | {mem_ratio} | "
            f"{r0['grad_bytes'] / 2**20:.2f} | {r0['optimizer_state_bytes'] / 2**20:.2f} | "
            f"{max(r['peak_rss_mib'] for r in ranks):.0f} | "
            f"{r0['comm_bytes_per_step'] / 2**20:.2f} | {r0['wire_bytes_per_step'] / 2**20:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
