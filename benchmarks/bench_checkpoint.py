"""Checkpoint save, load and training stall: zeroshard against its peers, one run.

    python benchmarks/bench_checkpoint.py            # the benchmark GPT (~30M parameters)

Every variant trains the benchmark GPT (examples/train_gpt.py) on 2 CPU ranks
(Gloo) and saves its whole training state (fp32 weights and AdamW moments):

- zeroshard stage 3: ``optimizer.save_checkpoint`` (synchronous and
  ``async_save=True``) and ``load_checkpoint``;
- FSDP2 (``fully_shard`` per block and at the root) + ``torch.optim.AdamW``:
  ``torch.distributed.checkpoint.save`` / ``async_save`` / ``load`` of
  ``get_state_dict`` (model and optimizer);
- DeepSpeed ZeRO stage 3 (when importable): ``engine.save_checkpoint`` /
  ``load_checkpoint`` (it has no asynchronous save in this configuration).

Reported, median over the repetitions: save time (until the checkpoint is on
disk and committed), load time, and the training stall: the wall time of the
save call plus the next training steps, minus the same number of undisturbed
steps (an asynchronous save stalls for its copy and for whatever the writer
thread takes from the training's cores). Results: results/checkpoint.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import io
import os
import platform
import queue
import shutil
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_arguments import add_gpt_arguments  # noqa: E402
from rank_setup import join_gloo_group  # noqa: E402

AFTER_STEPS = 3  # steps timed after a save call (the stall window)


class Trainer:
    """One variant's model, optimizer and checkpoint calls."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        from train_gpt import GPT, Block

        self.name, self.args = name, args
        torch.manual_seed(0)
        model = GPT(args.vocab, args.width, args.depth, args.heads, args.context)
        self.n_params = sum(p.numel() for p in model.parameters())
        world = dist.get_world_size()
        if name == "zeroshard":
            import zeroshard

            self.optimizer: Any = zeroshard.ZeroOptimizer(
                model.parameters(), "adamw", 3, module=model, unit_classes=(Block,), lr=1e-3
            )
            self.model: Any = model
        elif name == "fsdp2_dcp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        elif name == "deepspeed":
            import deepspeed

            config = {
                "train_micro_batch_size_per_gpu": args.global_batch // world,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3},
            }
            self.model, self.optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
        self.step_index = 0

    def step(self) -> None:
        args, rank, world = self.args, dist.get_rank(), dist.get_world_size()
        g = torch.Generator().manual_seed(self.step_index)
        self.step_index += 1
        seq = torch.randint(0, args.vocab, (args.global_batch, args.context + 1), generator=g)
        per_rank = args.global_batch // world
        seq = seq[rank * per_rank : (rank + 1) * per_rank]
        if self.name != "deepspeed":
            self.optimizer.zero_grad()
        logits = self.model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), seq[:, 1:].reshape(-1))
        if self.name == "deepspeed":
            self.model.backward(loss)
            self.model.step()
        else:
            loss.backward()
            self.optimizer.step()

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def save(self, path: str, asynchronous: bool) -> Any:
        """Starts a save; returns what finish() waits on."""
        if self.name == "zeroshard":
            self.optimizer.save_checkpoint(path, async_save=asynchronous)
            return None
        if self.name == "fsdp2_dcp":
            import torch.distributed.checkpoint as dcp

            if asynchronous:
                # Its own group, as torchtitan does: the writer thread's
                # collectives must not interleave with the training's.
                if not hasattr(self, "_dcp_group"):
                    self._dcp_group = dist.new_group(backend="gloo")
                return dcp.async_save(
                    self._dcp_state(), checkpoint_id=path, process_group=self._dcp_group
                )
            dcp.save(self._dcp_state(), checkpoint_id=path)
            return None
        self.model.save_checkpoint(path)
        return None

    def finish(self, handle: Any) -> None:
        if self.name == "zeroshard":
            self.optimizer.wait_for_checkpoint()
        elif handle is not None:
            handle.result()
        dist.barrier()

    def load(self, path: str) -> None:
        if self.name == "zeroshard":
            self.optimizer.load_checkpoint(path)
        elif self.name == "fsdp2_dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state = self._dcp_state()
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        else:
            self.model.load_checkpoint(path)

    @property
    def supports_async(self) -> bool:
        return self.name != "deepspeed"


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _run(rank: int, world: int, name: str, args: argparse.Namespace, init: str, out: Any) -> None:
    join_gloo_group(rank, world, init, threads=1, timeout=datetime.timedelta(minutes=10))
    trainer = Trainer(name, args)
    for _ in range(2):  # warm-up; creates the optimizer state
        trainer.step()
    steps = [_timed(trainer.step) for _ in range(5)]
    step_s = statistics.median(steps)
    result: dict[str, Any] = {"step_s": step_s, "n_params": trainer.n_params}
    base = os.path.join(args.dir, name)
    modes = ["sync", "async"] if trainer.supports_async else ["sync"]
    for mode in modes:
        saves, stalls = [], []
        for rep in range(args.repeats):
            path = f"{base}_{mode}_{rep}"
            dist.barrier()
            start = time.perf_counter()
            handle = trainer.save(path, mode == "async")
            for _ in range(AFTER_STEPS):
                trainer.step()
            dist.barrier()
            stalls.append(time.perf_counter() - start - AFTER_STEPS * step_s)
            trainer.finish(handle)
            saves.append(time.perf_counter() - start - AFTER_STEPS * step_s)
        result[f"{mode}_stall_s"] = statistics.median(stalls)
        result[f"{mode}_save_s"] = statistics.median(saves)
    loads = [_timed(lambda: trainer.load(f"{base}_sync_0")) for _ in range(args.repeats)]
    result["load_s"] = statistics.median(loads)
    buffer = io.BytesIO()
    torch.save(result, buffer)
    out.put((rank, buffer.getvalue()))
    dist.destroy_process_group()


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_run, args=(r, args.world_size, name, args, init, results))
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        try:
            collected = {}
            deadline = time.monotonic() + 1800
            while len(collected) < args.world_size:
                try:
                    rank, payload = results.get(timeout=5)
                except queue.Empty:
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        raise RuntimeError(f"{name}: ranks failed (exit codes {dead})") from None
                    continue
                collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=60)
    return collected[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_gpt_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="", help="comma-separated (default: all)")
    parser.add_argument("--dir", default="", help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "checkpoint"))
    args = parser.parse_args()
    cleanup = not args.dir
    args.dir = args.dir or tempfile.mkdtemp(prefix="zeroshard_bench_ckpt_")
    variants = args.variants.split(",") if args.variants else ["zeroshard", "fsdp2_dcp"]
    if not args.variants and importlib.util.find_spec("deepspeed") is not None:
        variants.append("deepspeed")
    rows = {}
    try:
        for name in variants:
            rows[name] = run_variant(name, args)
            print(name, {k: round(v, 3) for k, v in rows[name].items()}, flush=True)
    finally:
        if cleanup:
            shutil.rmtree(args.dir, ignore_errors=True)
    ours = rows["zeroshard"]
    lines = [
        "# Checkpoint save, load and training stall",
        "",
        f"`python benchmarks/bench_checkpoint.py` on {platform.processor() or platform.machine()}"
        f", {os.cpu_count()} cores, torch {torch.__version__}; the benchmark GPT "
        f"({ours['n_params'] / 1e6:.1f}M parameters, fp32 weights + AdamW moments), "
        f"{args.world_size} ranks (Gloo, one thread each), median of {args.repeats}. "
        "Save: until the checkpoint is on disk and committed. Stall: the save call plus "
        f"the next {AFTER_STEPS} training steps, minus {AFTER_STEPS} undisturbed steps. "
        "Ratios are the peer's time over zeroshard's, from the same run.",
        "",
        "| variant | step ms | save s | stall, sync s | stall, async s | async save s "
        "| load s | peer/zeroshard save | peer/zeroshard async stall | peer/zeroshard load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        async_stall = r.get("async_stall_s")
        lines.append(
            f"| {name} | {1e3 * r['step_s']:.0f} | {r['sync_save_s']:.2f} | "
            f"{r['sync_stall_s']:.2f} | "
            + (
                f"{async_stall:.2f} | {r['async_save_s']:.2f}"
                if async_stall is not None
                else "- | -"
            )
            + f" | {r['load_s']:.2f} | {r['sync_save_s'] / ours['sync_save_s']:.2f}x | "
            + (
                f"{async_stall / ours['async_stall_s']:.2f}x"
                if async_stall is not None and ours["async_stall_s"] > 0
                else "-"
            )
            + f" | {r['load_s'] / ours['load_s']:.2f}x |"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
