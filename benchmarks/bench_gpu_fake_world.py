"""What a step costs at W ranks, on one GPU: torch's fake process group.

    python benchmarks/bench_gpu_fake_world.py --out results.md            # GPU, ~0.67B GPT
    python benchmarks/bench_gpu_fake_world.py --device cpu --width 64 --depth 2 \\
        --vocab 256 --context 32 --batch 2 --steps 3 --warm-up 1 --out /tmp/smoke.md

One process is rank 0 of ``--world`` ranks (``dist.init_process_group("fake")``):
every collective returns at once and moves nothing, so each variant's step is
its compute, its memory and its host syncs at that world size, with no
network (values are garbage: nothing here checks numbers). Variants, each
built, measured and freed in turn:

- ``adamw_fused``: the model on one device, no sharding, torch.optim.AdamW
  (fused on CUDA): the step zeroshard's stages 1-2 are held to (1.05x).
- ``zeroshard_stage1`` .. ``zeroshard_stage3``: ZeroOptimizer over the fake group.
- ``fsdp2``: ``fully_shard`` per block and at the root + AdamW: stage 3's peer (1.1x).

Per variant: median step time after warm-up, peak memory (CUDA: allocated;
CPU: not measured), host syncs per step from zeroshard's counter and, on
CUDA, from the profiler (``cudaStreamSynchronize``, ``cudaEventSynchronize``,
``cudaDeviceSynchronize``, blocking ``cudaMemcpy``) over one step. Then, on
CUDA: a 4096x4096 bf16 GEMM with an aligned operand against one offset by an
element, and zeroshard stage 2 with CPU offload, pinned against pageable host
memory. The ``--device cpu`` run is the suite's check that this script works
(tests/python/test_gpu_ready.py); the figures that matter come from a GPU
(scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import zeroshard  # noqa: E402
from train_gpt import GPT  # noqa: E402

_SYNC_EVENTS = (
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpy",  # the blocking one; cudaMemcpyAsync is not counted
)
VARIANTS = ["adamw_fused", "zeroshard_stage1", "zeroshard_stage2", "zeroshard_stage3", "fsdp2"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warm-up", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", required=True, help="a Markdown table; JSON beside it")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(name: str, args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.depth, args.heads, args.context)
    model = model.to(device=device, dtype=torch.bfloat16)
    cuda = device.type == "cuda"
    if name == "adamw_fused":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    stage = int(name[-1])
    extra = {"module": model} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), "adamw", stage=stage, lr=1e-4, fused=cuda, **extra
    )
    return model, optimizer


def one_step(model: nn.Module, optimizer: Any, tokens: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    optimizer.step()


def profiled_syncs(model: nn.Module, optimizer: Any, tokens: torch.Tensor) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step(model, optimizer, tokens)
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name in _SYNC_EVENTS:
            counts[event.name] = counts.get(event.name, 0) + 1
    # The profiler's own closing synchronize is not the step's.
    counts["cudaDeviceSynchronize"] = counts.get("cudaDeviceSynchronize", 1) - 1
    return {k: v for k, v in counts.items() if v}


def measure(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model, optimizer = build(name, args, device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g).to(device)
    for _ in range(args.warm_up):
        one_step(model, optimizer, tokens)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    counter = getattr(optimizer, "host_sync_counts", None)
    syncs_before = sum(counter().values()) if counter else 0
    times = []
    for _ in range(args.steps):
        synchronize(device)
        start = time.perf_counter()
        one_step(model, optimizer, tokens)
        synchronize(device)
        times.append(time.perf_counter() - start)
    row: dict[str, Any] = {
        "variant": name,
        "step_ms": 1e3 * statistics.median(times),
        "step_ms_all": [1e3 * t for t in times],
        "params": sum(p.numel() for p in model.parameters()),
        "counted_syncs_per_step": (sum(counter().values()) - syncs_before) / args.steps
        if counter
        else None,
        "counted_reasons": counter() if counter else None,
    }
    if device.type == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        row["profiled_syncs_one_step"] = profiled_syncs(model, optimizer, tokens)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def gemm_alignment(device: torch.device) -> dict[str, float]:
    """A bf16 4096x4096 GEMM with an operand 16-byte aligned, and offset by one element."""
    n = 4096
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    storage = torch.randn(n * n + 8, device=device, dtype=torch.bfloat16)
    aligned = storage[: n * n].view(n, n)
    misaligned = storage[1 : n * n + 1].view(n, n)
    out = {}
    for label, b in (("aligned", aligned), ("offset_by_one_element", misaligned)):
        for _ in range(3):
            a @ b
        synchronize(device)
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        synchronize(device)
        out[f"{label}_ms"] = 1e3 * (time.perf_counter() - start) / 20
        out[f"{label}_ptr_mod_16"] = b.data_ptr() % 16
    return out


def offload_pinned_vs_pageable(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Stage 2 with the optimizer state on the host: pinned against pageable buffers."""
    out = {}
    depth = max(1, args.depth // 4)
    for pin in (True, False):
        torch.manual_seed(0)
        model = GPT(args.vocab, args.width, depth, args.heads, args.context).to(
            device=device, dtype=torch.bfloat16
        )
        optimizer = zeroshard.ZeroOptimizer(
            model.parameters(),
            "adamw",
            stage=2,
            offload_optimizer={"device": "cpu", "pin_memory": pin},
            sub_group_size=50_000_000,
        )
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), device=device)
        for _ in range(2):
            one_step(model, optimizer, tokens)
        synchronize(device)
        before = sum(optimizer.host_sync_counts().values())
        start = time.perf_counter()
        for _ in range(5):
            one_step(model, optimizer, tokens)
        synchronize(device)
        key = "pinned" if pin else "pageable"
        out[f"{key}_step_ms"] = 1e3 * (time.perf_counter() - start) / 5
        out[f"{key}_syncs_per_step"] = (sum(optimizer.host_sync_counts().values()) - before) / 5
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    rows = [measure(name, args, device) for name in args.variants.split(",")]
    extras: dict[str, Any] = {}
    if device.type == "cuda":
        extras["gemm"] = gemm_alignment(device)
        extras["offload"] = offload_pinned_vs_pageable(args, device)
    dist.destroy_process_group()
    baseline = {r["variant"]: r["step_ms"] for r in rows}
    lines = [
        f"# One GPU as rank 0 of {args.world} (fake process group), {device}",
        "",
        f"GPT width {args.width}, depth {args.depth}, vocab {args.vocab}, context "
        f"{args.context}, batch {args.batch}/rank, bf16; median of {args.steps} steps "
        f"after {args.warm_up}. {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| variant | params | step ms | vs peer | peak MiB | host syncs/step (counted) "
        "| profiled syncs (one step) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peer = "fsdp2" if r["variant"] in ("zeroshard_stage3",) else "adamw_fused"
        ratio = (
            f"{r['step_ms'] / baseline[peer]:.3f}x {peer}"
            if peer in baseline and r["variant"] != peer
            else ""
        )
        lines.append(
            f"| {r['variant']} | {r['params'] / 1e6:.0f}M | {r['step_ms']:.1f} | {ratio} | "
            f"{r.get('peak_mib', float('nan')):.0f} | {r['counted_syncs_per_step']} | "
            f"{r.get('profiled_syncs_one_step', '')} |"
        )
    for section, values in extras.items():
        lines += ["", f"**{section}**: " + ", ".join(f"{k} {v}" for k, v in values.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"args": vars(args), "rows": rows, **extras}, f, indent=1)


if __name__ == "__main__":
    main()
