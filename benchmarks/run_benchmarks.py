"""zeroshard against its peers: step time, memory and communication, in one run.

    python benchmarks/run_benchmarks.py                      # default: ~30M-parameter GPT
    python benchmarks/run_benchmarks.py --width 256 --depth 4 --vocab 1024 --steps 20

Every variant trains the same GPT (examples/train_gpt.py) on the same data
with the same ranks (CPU, Gloo), each in fresh processes so peak RSS is its
own: zeroshard stages 1, 2 and 3; DDP + torch.optim.AdamW;
torch.distributed.optim.ZeroRedundancyOptimizer (under DDP); FSDP2
(fully_shard per block and at the root); DeepSpeed ZeRO 1-3 on CPU when
``deepspeed`` is importable (peers are optional extras, never needed by the
tests). Reported per variant: median step time after warm-up, model-state
bytes per rank (parameters + gradients held after backward + optimizer state,
read from the tensors), peak process RSS, and bytes handed to collectives per
step (measured by zeroshard's counters; for peers, what their algorithm hands
over by design). Ratios against DDP and against each peer come from the same
run. Results: benchmarks/results/peers.md and peers.png.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import io
import os
import platform
import queue
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_arguments import add_gpt_arguments  # noqa: E402
from rank_setup import join_gloo_group  # noqa: E402

ZEROSHARD = [
    "zeroshard_stage1",
    "zeroshard_stage1_rsallreduce",
    "zeroshard_stage2",
    "zeroshard_stage2_rsallreduce",
    "zeroshard_stage3",
    "zeroshard_stage3_nowindow",
]
# CPU offload of the optimizer state and (stage 3) the parameters, against
# DeepSpeed with the same offload config:
#   python benchmarks/run_benchmarks.py --variants offload --out benchmarks/results/offload
OFFLOAD = ["zeroshard_stage3", "zeroshard_stage3_offload", "deepspeed_stage3_offload"]
PEERS = ["ddp_adamw", "zero_redundancy_optimizer", "fsdp2"]
DEEPSPEED = ["deepspeed_stage1", "deepspeed_stage2", "deepspeed_stage3"]


def tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # DTensor shards
        total += local.numel() * local.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        tensor_bytes(v for v in s.values() if isinstance(v, torch.Tensor))
        for s in optimizer.state.values()
    )


# Muon's hyper-parameters in the Muon variants (its lr matched to AdamW's RMS).
MUON = {"lr": 1e-3, "momentum": 0.95, "nesterov": True, "adjust_lr_fn": "match_rms_adamw"}


def muon_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon's recipe: the blocks' 2-D weights, and everything else (embeddings,
    head, biases, norms)."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in ids]


class MuonAndAdamW:
    """torch.optim's Muon and AdamW stepped together, as one optimizer."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.optimizers = (muon, adamw)

    @property
    def state(self) -> dict[Any, Any]:
        return {**self.optimizers[0].state, **self.optimizers[1].state}

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


# torch.optim classes a variant may name ("ddp_radam", "zeroshard_stage2_radam"):
# zeroshard runs them through TorchOptimizerRule (python/zeroshard/update_rules.py).
TORCH_CLASSES: dict[str, Any] = {
    "radam": torch.optim.RAdam,
    "adafactor": torch.optim.Adafactor,
}


class Variant:
    """Builds one training setup and reports its memory and traffic."""

    def __init__(self, name: str, model: nn.Module, args: argparse.Namespace) -> None:
        self.name = name
        self.model = model  # the module to call
        self.counted = model  # the module whose parameters are the model's
        self.args = args
        world = dist.get_world_size()
        lr = 1e-3
        if name == "ddp_adamw":
            self.model = nn.parallel.DistributedDataParallel(model)
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        elif name == "ddp_muon":
            # Muon's recipe: the blocks' 2-D weights in Muon, the rest in AdamW.
            self.model = nn.parallel.DistributedDataParallel(model)
            hidden, rest = muon_groups(model)
            self.optimizer = MuonAndAdamW(
                torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, lr=lr)
            )
        elif name.startswith("ddp_") and name[len("ddp_") :] in TORCH_CLASSES:
            # DDP + a torch.optim class run by torch: the yardstick of the
            # same class run by zeroshard (TorchOptimizerRule, in Python).
            self.model = nn.parallel.DistributedDataParallel(model)
            self.optimizer = TORCH_CLASSES[name[len("ddp_") :]](model.parameters(), lr=lr)
        elif name == "zero_redundancy_optimizer":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.model = nn.parallel.DistributedDataParallel(model)
            self.optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=lr)
        elif name == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        elif name.startswith("zeroshard_stage"):
            import zeroshard
            from train_gpt import Block

            stage = int(name[len("zeroshard_stage")])
            # Stage 3 units as FSDP2 is wrapped below: each block, and the rest.
            # "nowindow": no prefetch and no reuse window, every unit released
            # right after use (least memory, 3x the parameters gathered per step).
            stage3 = {"module": model, "unit_classes": (Block,)} if stage == 3 else {}
            if "_nowindow" in name:
                stage3["stage3_prefetch_bucket_size"] = 0
            # "rsallreduce": Gloo's reduce-scatter as c10d emulates it (an
            # all-reduce, twice the bytes on the wire) instead of zeroshard's
            # all-to-all plus local sum, to show what the all-to-all buys.
            if name.endswith("_rsallreduce"):
                stage3["gloo_reduce_scatter_all_to_all"] = False
            # "allgather": Gloo's own allgather for the parameter all-gathers
            # (it receives into a buffer of its own and copies out) instead of
            # zeroshard's in-place broadcast per rank, to show what that buys.
            if name.endswith("_allgather"):
                stage3["gloo_all_gather_broadcasts"] = False
            # "lockstep": stage 3 without the ranks' agreements (every rank
            # must run the same modules), to show what agreeing costs.
            if name.endswith("_lockstep"):
                stage3["check_collective_order"] = False
            # "fused": ATen's fused Adam kernel (torch.optim's fused=True).
            if name.endswith("_fused"):
                stage3["fused"] = True
            # "overlap": stage 1 reduce-scatters during backward, as stage 2 does.
            if name.endswith("_overlap"):
                stage3["stage1_reduce_in_backward"] = True
            if name.endswith("_offload"):
                stage3["offload_optimizer"] = "cpu"
                stage3["offload_param"] = "cpu"
            params: Any = model.parameters()
            inner: Any = "adamw"
            torch_class = name.rsplit("_", 1)[-1]
            if torch_class in TORCH_CLASSES:  # as ddp_<class>
                inner = TORCH_CLASSES[torch_class]
            if "_muon" in name:  # Muon's recipe, as ddp_muon
                hidden, rest = muon_groups(model)
                params = [
                    {"params": hidden, "optimizer": torch.optim.Muon, **MUON},
                    {"params": rest},
                ]
            self.optimizer = zeroshard.ZeroOptimizer(
                params,
                inner,
                stage=stage,
                lr=lr,
                reduce_bucket_size=args.bucket,
                **stage3,
            )
        elif name.startswith("deepspeed_stage"):
            import deepspeed

            config = {
                "train_micro_batch_size_per_gpu": args.global_batch // world,
                "gradient_accumulation_steps": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": lr}},
                "zero_optimization": {"stage": int(name[len("deepspeed_stage")])},
            }
            if name.endswith("_offload"):
                config["zero_optimization"].update(
                    {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
                )
            self.model, self.optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
        else:
            raise ValueError(f"unknown variant {name!r}")

    def zero_grad(self) -> None:
        if not self.name.startswith("deepspeed"):
            self.optimizer.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        if self.name.startswith("deepspeed"):
            self.model.backward(loss)
        else:
            loss.backward()

    def step(self) -> None:
        (self.model if self.name.startswith("deepspeed") else self.optimizer).step()

    def gradient_bytes(self) -> int | None:
        if self.name.startswith("zeroshard"):
            # On the device and, with offload, the shard in host memory.
            return self.optimizer.gradient_bytes() + self.optimizer.host_gradient_bytes()
        if self.name.startswith("deepspeed"):
            return None  # held in DeepSpeed's internal buffers, not in .grad
        return tensor_bytes(p.grad for p in self.counted.parameters())

    def state_bytes(self) -> int:
        if self.name.startswith("zeroshard"):
            return self.optimizer.optimizer_state_bytes()
        if self.name == "zero_redundancy_optimizer":
            return optimizer_state_bytes(self.optimizer.optim)
        if self.name.startswith("deepspeed"):
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            return optimizer_state_bytes(inner)
        return optimizer_state_bytes(self.optimizer)

    def collective_bytes(self, n_params: int, steps: int) -> tuple[float, str]:
        """Bytes handed to collectives per step and how the figure was obtained."""
        psi = 4 * n_params
        if self.name.startswith("zeroshard"):
            return self.optimizer.comm_stats()["total_bytes"] / steps, "measured"
        by_design = {
            "ddp_adamw": psi,  # all-reduce of the gradients
            "zero_redundancy_optimizer": 2 * psi,  # all-reduce + broadcast of params
            "fsdp2": 3 * psi,  # all-gather fwd + all-gather bwd + reduce-scatter
            "deepspeed_stage1": 2 * psi,
            "deepspeed_stage2": 2 * psi,
            "deepspeed_stage3": 3 * psi,
            "deepspeed_stage3_offload": 3 * psi,
        }
        return by_design[self.name], "by design"


def _run_variant(
    rank: int, world: int, name: str, args: argparse.Namespace, init_file: str, results: Any
) -> None:
    from train_gpt import GPT

    join_gloo_group(rank, world, init_file, threads=max(1, args.threads))
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.depth, args.heads, args.context)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = 4 * n_params
    variant = Variant(name, model, args)
    if name == "fsdp2":
        param_bytes = tensor_bytes(model.parameters())  # sharded between steps
    elif name.startswith("zeroshard_stage3"):
        param_bytes = variant.optimizer.parameter_bytes()  # shards + persistent
    elif name.startswith("deepspeed_stage3"):
        param_bytes = tensor_bytes(p.ds_tensor for p in model.parameters())  # partitions
    per_rank = args.global_batch // world
    times: list[float] = []
    grad_bytes = 0
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, args.vocab, (args.global_batch, args.context + 1), generator=g)
        seq = seq[rank * per_rank : (rank + 1) * per_rank]
        if step == args.warmup and name.startswith("zeroshard"):
            variant.optimizer.reset_comm_stats()
        dist.barrier()
        start = time.perf_counter()
        variant.zero_grad()
        logits = variant.model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), seq[:, 1:].reshape(-1))
        variant.backward(loss)
        if step == args.warmup:
            grad_bytes = variant.gradient_bytes()
        variant.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    comm, comm_source = variant.collective_bytes(n_params, args.steps)
    out = {
        "median_step_s": statistics.median(times),
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": variant.state_bytes(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "comm_bytes_per_step": comm,
        "comm_source": comm_source,
        "n_params": n_params,
    }
    buffer = io.BytesIO()
    torch.save(out, buffer)
    results.put((rank, buffer.getvalue()))
    dist.destroy_process_group()


def run_variant(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_run_variant, args=(r, args.world_size, name, args, f"{tmp}/rdzv", results)
            )
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        deadline = time.monotonic() + 3600
        while len(got) < len(procs):
            try:
                rank, payload = results.get(timeout=5)
                got[rank] = torch.load(io.BytesIO(payload))
            except queue.Empty:
                crashed = [p for p in procs if p.exitcode not in (None, 0)]
                if crashed or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    print(f"{name}: a rank failed or timed out; left out of the table", flush=True)
                    return []
        for p in procs:
            p.join()
    return [got[r] for r in range(args.world_size)]


def summarize(rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    summary = {}
    for name, ranks in rows.items():
        r0 = ranks[0]
        summary[name] = {
            "step_ms": statistics.median(r["median_step_s"] for r in ranks) * 1e3,
            "states_mib": (
                r0["param_bytes"] + (r0["grad_bytes"] or 0) + r0["optimizer_state_bytes"]
            )
            / 2**20,
            "grads_mib": None if r0["grad_bytes"] is None else r0["grad_bytes"] / 2**20,
            "optimizer_mib": r0["optimizer_state_bytes"] / 2**20,
            "rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "comm_mib": r0["comm_bytes_per_step"] / 2**20,
            "comm_source": r0["comm_source"],
        }
    return summary


def write_chart(summary: dict[str, dict[str, float]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(summary)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.barh(names, [summary[n]["step_ms"] for n in names], color="tab:blue")
    left.set_xlabel("median step time (ms)")
    right.barh(names, [summary[n]["states_mib"] for n in names], color="tab:green")
    right.set_xlabel("model-state memory per rank (MiB)")
    right.set_yticklabels([])
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def add_run_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    """The ranks, the GPT and the batch: what every benchmark of this GPT takes."""
    add_gpt_arguments(parser)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument(
        "--bucket",
        type=int,
        default=5_000_000,
        help="zeroshard reduce_bucket_size in elements (its default)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser, steps=10, warmup=2)
    default_variants = ZEROSHARD + PEERS
    if importlib.util.find_spec("deepspeed") is not None:
        default_variants += DEEPSPEED
    parser.add_argument(
        "--variants",
        default=",".join(default_variants),
        help="comma-separated names, or 'offload' for the CPU-offload comparison",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "peers"))
    args = parser.parse_args()
    if args.variants == "offload":
        args.variants = ",".join(OFFLOAD)

    rows = {}
    for name in args.variants.split(","):
        print(f"running {name} ...", flush=True)
        result = run_variant(name, args)
        if result:
            rows[name] = result
    summary = summarize(rows)
    n_params = next(iter(rows.values()))[0]["n_params"]
    peers = [n for n in summary if not n.startswith("zeroshard")]
    lines = [
        "# zeroshard against its peers",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
        f"Gloo on CPU, {args.world_size} ranks, {args.threads} thread(s) per rank",
        f"- model: GPT, {n_params / 1e6:.2f}M parameters (fp32, tied embedding), global batch "
        f"{args.global_batch} x {args.context} tokens; {args.steps} timed steps after "
        f"{args.warmup} warm-up; median over steps, then over ranks",
        "- model states = parameters + gradients held after backward + optimizer state, rank 0, "
        "read from the tensors (FSDP2: local shards; DeepSpeed stage 3: its partitions). "
        "DeepSpeed keeps gradients in internal buffers not visible here: n/a, and its model "
        "states are a lower bound (≥)",
        "- collective bytes: the buffers handed to collectives per step; zeroshard's are "
        "measured by its counters, the peers' follow from their algorithm (marked). Gloo has "
        "no native reduce-scatter: c10d emulates it with an all-reduce (each rank sends "
        "2(W-1)/W of the buffer); zeroshard's default reduce-scatter on Gloo is one "
        "all-to-all plus a local sum ((W-1)/W, as a ring reduce-scatter), the "
        "`_rsallreduce` rows use c10d's emulation. Same bytes handed over, half on the wire. "
        "FSDP2 and DeepSpeed use the emulation.",
        "",
        "| variant | median step (ms) | model states (MiB) | gradients (MiB) | "
        "optimizer state (MiB) | peak RSS (MiB) | collective MiB/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        mark = "" if s["comm_source"] == "measured" else " (by design)"
        grads = "n/a" if s["grads_mib"] is None else f"{s['grads_mib']:.2f}"
        states = ("≥ " if s["grads_mib"] is None else "") + f"{s['states_mib']:.2f}"
        lines.append(
            f"| {name} | {s['step_ms']:.1f} | {states} | {grads} | "
            f"{s['optimizer_mib']:.2f} | {s['rss_mib']:.0f} | {s['comm_mib']:.2f}{mark} |"
        )
    lines += [
        "",
        "Ratios of each zeroshard stage against each peer (step time, model states; "
        "below 1 is better for zeroshard):",
        "",
        "| zeroshard | " + " | ".join(peers) + " |",
        "|---|" + "---|" * len(peers),
    ]
    for name in (n for n in summary if n.startswith("zeroshard")):
        cells = [
            f"{summary[name]['step_ms'] / summary[p]['step_ms']:.2f} / "
            f"{summary[name]['states_mib'] / summary[p]['states_mib']:.2f}"
            for p in peers
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if write_chart(summary, args.out + ".png"):
        lines += ["", f"![step time and memory]({os.path.basename(args.out)}.png)"]
    text = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
