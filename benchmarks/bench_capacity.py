"""Capacity: a GPT whose model states do not fit in this machine's RAM, trained with
ZeRO-3 and the optimizer state on NVMe.

    python benchmarks/bench_capacity.py --depth 26 --width 2560 --nvme-path /var/tmp

Two CPU ranks (Gloo) build the model on the meta device (each rank
materializes only its shards: partitioned construction), train it in bf16
with fp32 master weights and AdamW moments in a swap file per rank, and
report per step: the loss, the forward+backward time, the optimizer step's
time and the part of it spent waiting for I/O, the bytes swapped, and each
rank's peak RSS. With the default sizes (2.05B parameters) the model states
are 16 bytes/parameter = 32.7 GB against this machine's 24 GiB of RAM.
Results: results/capacity.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_arguments import add_capacity_arguments  # noqa: E402
from rank_setup import join_gloo_group  # noqa: E402


def rss_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rank_main(rank: int, world: int, init_file: str, args: argparse.Namespace, out: Any) -> None:
    import zeroshard
    from train_gpt import GPT, Block

    join_gloo_group(rank, world, init_file, timeout=datetime.timedelta(seconds=3600))
    with torch.device("meta"):
        model = GPT(args.vocab, args.width, args.depth, args.heads, args.context)
    model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    start = time.perf_counter()
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=3,
        module=model,
        unit_classes=(Block,),
        lr=1e-4,
        offload_optimizer={
            "device": "nvme",
            "nvme_path": args.nvme_path,
            "buffer_count": args.buffer_count,
        },
        offload_param=(
            {"device": "nvme", "nvme_path": args.nvme_path, "max_in_cpu": 0}
            if args.offload_param == "nvme"
            else None
        ),
        sub_group_size=args.sub_group_size,
        aio={"queue_depth": 32, "block_size": 1 << 20},
    )
    setup_seconds = time.perf_counter() - start
    rows = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step % 2)  # two batches, repeated: the loss must fall
        seq = torch.randint(0, args.vocab, (args.batch * world, args.context + 1), generator=g)
        seq = seq[rank * args.batch : (rank + 1) * args.batch]
        params_before = optimizer.nvme_stats().get("parameters", {})
        begin = time.perf_counter()
        optimizer.zero_grad()
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.float().reshape(-1, args.vocab), seq[:, 1:].reshape(-1)
        )
        loss.backward()
        compute = time.perf_counter() - begin
        before = optimizer.nvme_stats()
        begin = time.perf_counter()
        optimizer.step()
        step_seconds = time.perf_counter() - begin
        after = optimizer.nvme_stats()
        params_after = after.get("parameters", {})
        rows.append(
            {
                "param_read": params_after.get("bytes_read", 0)
                - params_before.get("bytes_read", 0),
                "param_wait": params_after.get("io_wait_seconds", 0.0)
                - params_before.get("io_wait_seconds", 0.0),
                "loss": loss.item(),
                "compute": compute,
                "step": step_seconds,
                "io_wait": after["io_wait_seconds"] - before["io_wait_seconds"],
                "swapped": after["bytes_read"]
                - before["bytes_read"]
                + after["bytes_written"]
                - before["bytes_written"],
                "rss_peak": rss_peak_gib(),
            }
        )
        if rank == 0:
            print(f"step {step}: {rows[-1]}", flush=True)
    stats = optimizer.nvme_stats()
    out.put(
        (
            rank,
            {
                "params": n_params,
                "setup": setup_seconds,
                "rows": rows,
                "disk_bytes": stats["disk_bytes"],
                "buffer_bytes": stats["buffer_bytes"],
                "backend": stats["backend"],
                "param_disk_bytes": stats.get("parameters", {}).get("disk_bytes", 0),
            },
        )
    )
    del optimizer
    dist.destroy_process_group()


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def deepspeed_lines(
    theirs: dict[str, Any], ours: list[dict[str, Any]], args: argparse.Namespace
) -> list[str]:
    """The DeepSpeed rows, and the two side by side on the steps both ran."""
    lines = [
        "## DeepSpeed 0.19.8 with the same configuration, on the same machine in the same run",
        "",
        '`deepspeed.zero.Init(remote_device="nvme")` (partitioned construction), bf16, '
        "AdamW (DeepSpeedCPUAdam), `offload_optimizer` and `offload_param` on NVMe "
        f"(max_in_cpu 0), sub_group_size {args.sub_group_size:,}, buffer_count "
        f"{args.buffer_count}, the same `aio` section and batches "
        "(benchmarks/capacity_deepspeed.py)."
        + (f" Construction took {theirs['setup']:.0f} s." if theirs["setup"] is not None else ""),
        "",
    ]
    rows = theirs["rows"][0]
    if rows:
        lines += [
            "| step | loss | forward+backward (s) | optimizer step (s) | "
            "peak RSS rank 0 / 1 (GiB) |",
            "|---|---|---|---|---|",
        ]
        other = theirs["rows"][1]
        for i, row in enumerate(rows):
            rss1 = f"{other[i]['rss_peak']:.2f}" if i < len(other) else "n/a"
            lines.append(
                f"| {i} | {row['loss']:.4f} | {row['compute']:.1f} | {row['step']:.1f} | "
                f"{row['rss_peak']:.2f} / {rss1} |"
            )
        lines.append("")
    if theirs["error"]:
        lines += [f"DeepSpeed stopped: {theirs['error']}", ""]
    both = min(len(rows), len(ours))
    if both:
        # Step 0 pays for first-touch and (DeepSpeed) tracing: compare the later steps.
        skip = 1 if both > 1 else 0
        ds = _median([r["compute"] + r["step"] for r in rows[skip:both]])
        zs = _median([r["compute"] + r["step"] for r in ours[skip:both]])
        ds_rss = max(r["rss_peak"] for r in rows[:both])
        zs_rss = max(r["rss_peak"] for r in ours[:both])
        lines += [
            f"Side by side over steps {skip}-{both - 1}: median time per step (forward+backward+"
            f"optimizer) zeroshard {zs:.1f} s, DeepSpeed {ds:.1f} s (zeroshard/DeepSpeed "
            f"{zs / ds:.2f}); peak RSS rank 0 zeroshard {zs_rss:.2f} GiB, DeepSpeed "
            f"{ds_rss:.2f} GiB.",
            "",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=26)
    add_capacity_arguments(parser, steps=5)
    parser.add_argument(
        "--offload-param", choices=["none", "nvme"], default="none", help="parameter shards too"
    )
    parser.add_argument(
        "--deepspeed",
        action="store_true",
        help="then DeepSpeed 0.19 with the same configuration (needs --offload-param nvme)",
    )
    parser.add_argument("--deepspeed-deadline", type=int, default=1200, help="seconds")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "capacity.md"))
    args = parser.parse_args()
    if args.deepspeed and args.offload_param != "nvme":
        parser.error("--deepspeed compares the full ZeRO-Infinity setup: add --offload-param nvme")
    world = 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=rank_main, args=(r, world, os.path.join(tmp, "rendezvous"), args, results)
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        collected = dict(results.get() for _ in range(world))
        for p in procs:
            p.join()
    r0 = collected[0]
    psi = r0["params"]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lines = [
        "# Capacity: model states larger than RAM, trained with ZeRO-3 + NVMe offload",
        "",
        f"`python benchmarks/bench_capacity.py --depth {args.depth} --width {args.width} "
        f"--nvme-path {args.nvme_path} --offload-param {args.offload_param}` on "
        f"{platform.node() or 'this machine'} "
        f"({os.cpu_count()} cores, {ram / 2**30:.1f} GiB RAM), torch {torch.__version__}.",
        "",
        f"GPT with {psi / 1e9:.2f}B parameters in bf16 (fp32 master + AdamW moments: 16 "
        f"bytes/parameter = {16 * psi / 1e9:.1f} GB of model states), 2 CPU ranks (Gloo), "
        f"stage 3 with partitioned construction, `offload_optimizer` on NVMe "
        f"({r0['backend']}; {r0['disk_bytes'] / 1e9:.1f} GB swap per rank, host buffers "
        f"{r0['buffer_bytes'] / 1e9:.2f} GB per rank: buffer_count {args.buffer_count} x "
        f"sub_group_size {args.sub_group_size:,}), {args.batch} x {args.context} tokens per "
        f"rank per step. Construction took {r0['setup']:.0f} s."
        + (
            f" `offload_param` on NVMe too (max_in_cpu 0): {r0['param_disk_bytes'] / 1e9:.2f} GB "
            "of bf16 parameter shards per rank on disk, read ahead of each all-gather."
            if args.offload_param == "nvme"
            else ""
        ),
        "",
        "| step | loss | forward+backward (s) | of which parameter reads (GB / wait s) | "
        "optimizer step (s) | of which I/O wait (s) | "
        "swapped per rank (GB) | swap GB/s per rank | peak RSS rank 0 / 1 (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(r0["rows"]):
        other = collected[1]["rows"][i]
        lines.append(
            f"| {i} | {row['loss']:.4f} | {row['compute']:.1f} | "
            f"{row['param_read'] / 1e9:.2f} / {row['param_wait']:.1f} | {row['step']:.1f} | "
            f"{row['io_wait']:.1f} | {row['swapped'] / 1e9:.1f} | "
            f"{row['swapped'] / 1e9 / row['step']:.2f} | {row['rss_peak']:.2f} / "
            f"{other['rss_peak']:.2f} |"
        )
    lines += [
        "",
        "Even steps train on one batch and odd steps on another: each one's loss falls. "
        "The same configuration without offload would need the 16 bytes/parameter in RAM "
        f"({16 * psi / 2 / 2**30:.1f} GiB per rank at stage 3, both "
        f"ranks {16 * psi / 2**30:.1f} GiB, against {ram / 2**30:.1f} GiB).",
        "",
    ]
    if args.deepspeed:
        import capacity_deepspeed

        lines += deepspeed_lines(capacity_deepspeed.run(args, world), r0["rows"], args)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
