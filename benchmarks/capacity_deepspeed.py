"""DeepSpeed 0.19 on bench_capacity.py's model and configuration, for the side-by-side rows.

The same GPT, built the DeepSpeed way (``deepspeed.zero.Init`` with
``remote_device="nvme"``: each rank materializes only its partitions), with
the same ZeRO-3 settings: bf16, AdamW, ``offload_optimizer`` and
``offload_param`` on NVMe, the same ``sub_group_size``, ``buffer_count`` and
``aio`` section, 2 Gloo ranks, the same batches. Each rank reports its rows
as it goes, so a run that is killed (out of memory) or passes its deadline
still shows how far it got and why it stopped.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import resource
import shutil
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp
from rank_setup import join_gloo_group
from torch import nn


def describe_error(error: BaseException) -> str:
    """An exception in one line, with the line that raised it (for a table cell)."""
    lines = str(error).strip().splitlines()
    where = traceback.extract_tb(error.__traceback__)[-1]
    origin = f" (at {os.path.basename(where.filename)}:{where.lineno}: {where.line})"
    return f"{type(error).__name__}: {lines[-1] if lines else ''}{origin}"[:400]


def deepspeed_config(args: argparse.Namespace, swap: str, world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "train_batch_size": args.batch * world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": swap,
                "buffer_count": args.buffer_count,
            },
            "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
            "sub_group_size": args.sub_group_size,
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32},
    }


def rank_main(
    rank: int, world: int, init_file: str, args: argparse.Namespace, swap: str, out: Any
) -> None:
    # The group exists before DeepSpeed looks for one.
    join_gloo_group(rank, world, init_file, timeout=datetime.timedelta(seconds=3600))
    try:
        import deepspeed

        from train_gpt import GPT

        # zero.Init parses its config before it sets up deepspeed.comm, and a config
        # parsed without it sees world size 1: set it up first, as DeepSpeed's docs do.
        deepspeed.init_distributed(dist_backend="gloo")
        config = deepspeed_config(args, swap, world)
        torch.manual_seed(0)
        start = time.perf_counter()
        with deepspeed.zero.Init(
            config_dict_or_path=config, remote_device="nvme", dtype=torch.bfloat16
        ):
            model = GPT(args.vocab, args.width, args.depth, args.heads, args.context)
        # GPT.__init__ initializes its embeddings after zero.Init has already
        # partitioned them, so that init touched empty placeholders (the loss
        # starts near 170 instead of 5.8): redo it on the gathered tensors, as
        # DeepSpeed's docs prescribe.
        for embedding in (model.token, model.position):
            with deepspeed.zero.GatheredParameters(embedding.weight, modifier_rank=0):
                if rank == 0:
                    nn.init.normal_(embedding.weight, std=0.02)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        out.put((rank, "setup", time.perf_counter() - start))
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step % 2)  # bench_capacity.py's batches
            seq = torch.randint(0, args.vocab, (args.batch * world, args.context + 1), generator=g)
            seq = seq[rank * args.batch : (rank + 1) * args.batch]
            begin = time.perf_counter()
            logits = engine(seq[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.float().reshape(-1, args.vocab), seq[:, 1:].reshape(-1)
            )
            engine.backward(loss)
            compute = time.perf_counter() - begin
            begin = time.perf_counter()
            engine.step()
            row = {
                "loss": loss.item(),
                "compute": compute,
                "step": time.perf_counter() - begin,
                "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            }
            out.put((rank, "row", row))
        out.put((rank, "done", None))
    except Exception as error:  # noqa: BLE001 - reported in the table
        out.put((rank, "error", describe_error(error)))


def run(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Runs DeepSpeed's ranks until they finish, fail, die or pass the deadline."""
    result: dict[str, Any] = {"rows": {r: [] for r in range(world)}, "setup": None}
    swap = tempfile.mkdtemp(prefix="deepspeed-swap-", dir=args.nvme_path)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    finished: dict[int, str] = {}
    deadline = time.monotonic() + args.deepspeed_deadline
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=rank_main,
                args=(r, world, os.path.join(tmp, "rendezvous"), args, swap, out),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            while len(finished) < world and time.monotonic() < deadline:
                try:
                    rank, kind, value = out.get(timeout=5)
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in finished and not p.is_alive():
                            finished[r] = f"rank {r} died (exit code {p.exitcode})"
                    continue
                if kind == "setup":
                    result["setup"] = value if rank == 0 else result["setup"]
                elif kind == "row":
                    result["rows"][rank].append(value)
                    if rank == 0:
                        print(f"deepspeed step {len(result['rows'][0]) - 1}: {value}", flush=True)
                elif kind == "error":
                    finished[rank] = f"rank {rank}: {value}"
                else:
                    finished[rank] = ""
            if len(finished) < world:
                finished[-1] = (
                    f"stopped at the {args.deepspeed_deadline} s deadline after "
                    f"{len(result['rows'][0])} of {args.steps} steps"
                )
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            shutil.rmtree(swap, ignore_errors=True)
    errors = sorted({text for text in finished.values() if text})
    result["error"] = "; ".join(errors) if errors else None
    return result
