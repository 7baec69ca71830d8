"""The largest GPT this machine trains, without offload and with NVMe offload:
the estimator's prediction next to what actually ran.

    python benchmarks/bench_largest.py --nvme-path /var/tmp

For each setting (stage 3 in RAM; stage 3 with optimizer state and
parameters on NVMe), the estimator's own fit decision (the one
``zero_optimization.stage: "auto"`` makes: ``resolve_auto``), given this
machine's free RAM and free disk measured at the start, with the activations
of one micro-batch counted, picks the deepest GPT of bench_capacity.py's
width that fits. That model is then built (partitioned construction) and
trained for a few steps on 2 CPU ranks, and the table shows the predicted
bytes next to the measured ones: the peak RSS of the two ranks together
(sampled by this process every 0.2 s while they run, so the figure is the
node's, not a sum of two peaks at different times) and the swap files' size.
A watchdog stops the ranks before the node runs out of memory, so a
prediction that is too small shows as a stopped run rather than the kernel's
OOM killer picking a victim. Results: results/largest.md.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import queue
import shutil
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

WORLD = 2
SETTINGS = {"ram": "stage 3, no offload", "nvme": "stage 3, optimizer + parameters on NVMe"}


def zero_section(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """The DeepSpeed ``zero_optimization`` section of a setting (stage left to "auto")."""
    section: dict[str, Any] = {"stage": "auto", "sub_group_size": args.sub_group_size}
    if setting == "nvme":
        section["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": args.nvme_path,
            "buffer_count": args.buffer_count,
        }
        section["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path, "max_in_cpu": 0}
    return section


def build_meta(depth: int, args: argparse.Namespace) -> nn.Module:
    from train_gpt import GPT

    with torch.device("meta"):
        return GPT(args.vocab, args.width, depth, args.heads, args.context)


def prediction(
    depth: int, setting: str, args: argparse.Namespace, host: float, disk: float
) -> dict[str, Any]:
    """The estimator's decision and figures for this depth, as "auto" would make it."""
    from zeroshard import _C
    from zeroshard.estimator import count_model, estimate

    n_params, largest_unit = count_model(build_meta(depth, args))
    activations = float(
        _C.estimate_activation_bytes(
            depth, args.width, args.heads, args.vocab, args.context, args.batch, 2, False, 1
        )
    )
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW"},
        "zero_optimization": zero_section(setting, args),
    }
    parsed = _C.parse_deepspeed_config(json.dumps(config), WORLD)
    try:
        decision = parsed.resolve_auto(
            float(n_params),
            float(largest_unit),
            WORLD,
            0.0,
            host,
            disk if setting == "nvme" else -1.0,
            True,  # a CPU device: the ranks' device bytes are in the RAM
            True,  # units: stage 3
            activations,
        )
        fits = True
    except ValueError as error:
        decision, fits = str(error), False
    offload = "nvme" if setting == "nvme" else "none"
    (row,) = estimate(
        n_params,
        world_size=WORLD,
        ranks_per_node=WORLD,
        offload_optimizer=offload,
        offload_param=offload,
        largest_unit_params=largest_unit,
        stages=(3,),
        sub_group_size=args.sub_group_size,
        nvme_buffer_count=args.buffer_count,
        param_max_in_cpu=0,
        activation_bytes=activations,
        host_device=True,  # Gloo on CPU tensors: the all-to-all receive buffers
    )
    return {
        "depth": depth,
        "params": n_params,
        "fits": fits,
        "decision": decision,
        # choose_configuration's rule for a CPU device: both ranks' device bytes
        # in RAM; and the ranks' own processes, which "auto" finds already
        # running (see rank_baseline_bytes).
        "host_bytes": row["cpu_bytes_per_node"]
        + WORLD * (row["device_bytes"] + args.rank_baseline),
        "nvme_bytes": row["nvme_bytes_per_node"],
        "activations": activations,
    }


def largest_fitting(
    setting: str, args: argparse.Namespace, host: float, disk: float
) -> dict[str, Any] | None:
    """The deepest model that fits (fit is monotone in depth: bisect)."""
    low, high = 0, 1
    while prediction(high, setting, args, host, disk)["fits"]:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (
            (mid, high) if prediction(mid, setting, args, host, disk)["fits"] else (low, mid)
        )
    if low == 0:
        return None
    chosen = prediction(low, setting, args, host, disk)
    chosen["next"] = prediction(low + 1, setting, args, host, disk)
    return chosen


def _baseline_main(init_file: str, out: Any) -> None:
    import zeroshard  # noqa: F401 - what a rank has loaded before it builds the model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    out.put(_rss_bytes(os.getpid()))
    dist.destroy_process_group()


def rank_baseline_bytes() -> int:
    """The RSS of a rank before its model: Python, torch, zeroshard, a process group.

    A rank that resolves "auto" itself measures the memory free with every
    rank already started; this benchmark decides in the parent before the
    ranks exist, so it takes their baseline off the free memory first.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        process = ctx.Process(target=_baseline_main, args=(os.path.join(tmp, "rdv"), out))
        process.start()
        baseline = out.get(timeout=300)
        process.join()
    return baseline


def rank_main(
    rank: int, init_file: str, depth: int, setting: str, args: argparse.Namespace, out: Any
) -> None:
    import zeroshard
    from train_gpt import Block

    join_gloo_group(rank, WORLD, init_file, timeout=datetime.timedelta(seconds=3600))
    try:
        model = build_meta(depth, args).to(torch.bfloat16)
        torch.manual_seed(0)
        nvme = {"nvme_path": args.nvme_path}
        start = time.perf_counter()
        optimizer = zeroshard.ZeroOptimizer(
            model.parameters(),
            "adamw",
            stage=3,
            module=model,
            unit_classes=(Block,),
            lr=1e-4,
            offload_optimizer=(
                {"device": "nvme", "buffer_count": args.buffer_count, **nvme}
                if setting == "nvme"
                else None
            ),
            offload_param={"device": "nvme", "max_in_cpu": 0, **nvme}
            if setting == "nvme"
            else None,
            sub_group_size=args.sub_group_size,
            aio={"queue_depth": 32, "block_size": 1 << 20},
        )
        out.put((rank, "setup", time.perf_counter() - start))
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step % 2)  # two batches: each one's loss falls
            seq = torch.randint(0, args.vocab, (args.batch * WORLD, args.context + 1), generator=g)
            seq = seq[rank * args.batch : (rank + 1) * args.batch]
            begin = time.perf_counter()
            optimizer.zero_grad()
            logits = model(seq[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.float().reshape(-1, args.vocab), seq[:, 1:].reshape(-1)
            )
            loss.backward()
            optimizer.step()
            out.put((rank, "row", {"loss": loss.item(), "seconds": time.perf_counter() - begin}))
        stats = optimizer.nvme_stats() if setting == "nvme" else {}
        disk = stats.get("disk_bytes", 0) + stats.get("parameters", {}).get("disk_bytes", 0)
        out.put((rank, "done", disk))
        del optimizer
    except Exception as error:  # noqa: BLE001 - reported in the table
        out.put((rank, "error", f"{type(error).__name__}: {str(error).strip()[:300]}"))
    dist.destroy_process_group()


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mem_available() -> float:
    from zeroshard.auto import _host_available_bytes

    return _host_available_bytes()


def run(depth: int, setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """Trains the model on WORLD ranks, sampling their RSS; stops them before OOM."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    result: dict[str, Any] = {"rows": [], "error": None, "setup": None, "disk": 0}
    finished: set[int] = set()
    node_peak = 0
    swap_before = set(glob.glob(os.path.join(args.nvme_path, "zeroshard-*-rank*")))
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=rank_main,
                args=(r, os.path.join(tmp, "rendezvous"), depth, setting, args, out),
            )
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        try:
            while len(finished) < WORLD:
                node_peak = max(node_peak, sum(_rss_bytes(p.pid) for p in procs))
                if _mem_available() < args.reserve * 2**30:
                    result["error"] = (
                        f"stopped by the watchdog: the node had under {args.reserve} GiB "
                        f"available with the ranks at {node_peak / 2**30:.2f} GiB of RSS"
                    )
                    break
                try:
                    rank, kind, value = out.get(timeout=0.2)
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs) if r not in finished and not p.is_alive()
                    ]
                    if dead:
                        result["error"] = (
                            f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})"
                        )
                        break
                    continue
                if kind == "setup" and rank == 0:
                    result["setup"] = value
                elif kind == "row" and rank == 0:
                    result["rows"].append(value)
                    print(
                        f"  depth {depth} {setting} step {len(result['rows'])}: {value}", flush=True
                    )
                elif kind == "error":
                    result["error"] = f"rank {rank}: {value}"
                    break
                elif kind == "done":
                    finished.add(rank)
                    result["disk"] += value
        finally:
            for p in procs:
                p.join(timeout=60 if result["error"] is None else 1)
                if p.is_alive():
                    p.kill()
                    p.join()
            # A killed rank cannot remove its swap directory: this run's are removed here.
            for stale in (
                set(glob.glob(os.path.join(args.nvme_path, "zeroshard-*-rank*"))) - swap_before
            ):
                shutil.rmtree(stale, ignore_errors=True)
    result["node_peak"] = node_peak
    return result


def table_row(setting: str, predicted: dict[str, Any], result: dict[str, Any], first: bool) -> str:
    rows = result["rows"]
    losses = (
        f"{rows[0]['loss']:.3f} -> {rows[-1 if len(rows) % 2 else -2]['loss']:.3f}"
        if len(rows) >= 3
        else ", ".join(f"{r['loss']:.3f}" for r in rows)
    )
    steady = [r["seconds"] for r in rows[1:]] or [r["seconds"] for r in rows]
    per_step = f"{sorted(steady)[len(steady) // 2]:.1f}" if steady else ""
    disk_cell = (
        f"{predicted['nvme_bytes'] / 1e9:.1f} / {result['disk'] / 1e9:.1f}"
        if setting == "nvme"
        else "0 / 0"
    )
    outcome = result["error"] or f"trained {len(rows)} steps"
    if result["setup"] is not None:
        outcome += f" (construction {result['setup']:.0f} s)"
    which = "the estimator's largest" if first else "smaller"
    return (
        f"| {SETTINGS[setting]} | {predicted['depth']} ({which}) | "
        f"{predicted['params'] / 1e9:.2f}B | {predicted['host_bytes'] / 1e9:.2f} | "
        f"{result['node_peak'] / 1e9:.2f} | {disk_cell} | {losses} | {per_step} | {outcome} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_capacity_arguments(parser, steps=3)
    parser.add_argument(
        "--reserve", type=float, default=0.5, help="GiB the watchdog keeps available"
    )
    parser.add_argument(
        "--disk-reserve",
        type=float,
        default=5.0,
        help="GB of the free disk left out of the prediction (the disk is shared)",
    )
    parser.add_argument("--retries", type=int, default=2, help="smaller depths tried on failure")
    parser.add_argument(
        "--step-down", type=float, default=0.75, help="depth factor from one try to the next"
    )
    parser.add_argument(
        "--settings", default="ram,nvme", help="comma-separated: " + ", ".join(SETTINGS)
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "largest.md"))
    args = parser.parse_args()

    args.rank_baseline = rank_baseline_bytes()
    available = _mem_available()
    host = available - WORLD * args.rank_baseline
    disk = float(shutil.disk_usage(args.nvme_path).free) - args.disk_reserve * 1e9
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(
        f"available: {available / 1e9:.2f} GB RAM ({host / 1e9:.2f} GB after {WORLD} ranks' "
        f"baseline), {disk / 1e9:.2f} GB at {args.nvme_path}",
        flush=True,
    )
    lines = [
        "# The largest model this machine trains: the estimator's prediction and the run",
        "",
        f"`python benchmarks/bench_largest.py --nvme-path {args.nvme_path}` on "
        f"{platform.node() or 'this machine'} ({os.cpu_count()} cores, "
        f"{ram / 2**30:.1f} GiB RAM), torch {torch.__version__}. Free at the start: "
        f"{available / 1e9:.2f} GB of RAM (MemAvailable), {disk / 1e9:.2f} GB of disk at "
        f"`{args.nvme_path}` (after leaving {args.disk_reserve:.0f} GB to the rest of the "
        f"machine). A rank's process before its model (Python, torch, zeroshard, a process "
        f"group) is {args.rank_baseline / 1e9:.2f} GB of RSS: the fit is decided on the "
        f"{host / 1e9:.2f} GB left after {WORLD} of them, as a rank resolving "
        '"auto" itself would find it, and the predicted RAM includes them.',
        "",
        "Predicted RAM counts the model states, activations, the gradient buckets (3 of "
        "the largest, a unit at stage 3, with their reduced shards and Gloo's all-to-all "
        "receive buffers) and the gathered units (`zeroshard.estimate`'s `staging_bytes` "
        "and `working_bytes`).",
        "",
        f"bench_capacity.py's GPT (width {args.width}, {args.heads} heads, vocabulary "
        f"{args.vocab}, {args.batch} x {args.context} tokens per rank), bf16 with fp32 master "
        f"weights and AdamW, 2 CPU ranks (Gloo), partitioned construction. For each setting "
        "the depth is the largest the estimator's fit rule accepts (the decision `stage: "
        '"auto"` makes, activations of one micro-batch counted); depth + 1 is what it '
        "refuses. Predicted RAM is per node (both ranks: on a CPU device their device bytes "
        "are RAM too); measured is the two ranks' RSS together, sampled every 0.2 s.",
        "",
        "| setting | depth | parameters | predicted RAM (GB) | measured peak RAM "
        "(GB) | predicted / measured disk (GB) | loss, first -> last of the same batch | "
        "s per step | outcome |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for setting in args.settings.split(","):
        chosen = largest_fitting(setting, args, host, disk)
        if chosen is None:
            lines.append(f"| {SETTINGS[setting]} | none fits | | | | | | | |")
            continue
        print(f"{setting}: depth {chosen['depth']}: {chosen['decision']}", flush=True)
        # One row per run: the estimator's largest first, then (where it did
        # not fit after all) smaller ones, each with its own prediction.
        depth, attempts = chosen["depth"], 0
        while True:
            predicted = (
                chosen if depth == chosen["depth"] else prediction(depth, setting, args, host, disk)
            )
            result = run(depth, setting, args)
            lines.append(table_row(setting, predicted, result, first=attempts == 0))
            attempts += 1
            if result["error"] is None or attempts > args.retries or depth <= 1:
                break
            depth = max(1, int(depth * args.step_down))
            print(f"{setting}: {result['error']}: trying depth {depth}", flush=True)
        notes += [
            f"- {SETTINGS[setting]}, depth {chosen['depth']}: {chosen['decision']} "
            f"(activations {chosen['activations'] / 1e9:.3f} GB per rank). Depth "
            f"{chosen['depth'] + 1}: {chosen['next']['decision']}",
        ]
    lines += ["", "The estimator's decisions, as printed:", "", *notes, ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
