"""Trains a small GPT with zeroshard under torchrun.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --steps 120

CPU ranks talk over Gloo; when every rank has a GPU the script uses NCCL.
The data is a synthetic copy task (each sequence is a random half followed by
the same half again), so the loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time

import torch
import torch.distributed as dist
from torch import nn

import zeroshard


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.token.weight  # tied input/output embedding
        for embedding in (self.token, self.position):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--print-every", type=int, default=20)
    parser.add_argument(
        "--offload-optimizer",
        choices=["none", "cpu", "nvme"],
        default="none",
        help="where the optimizer state and step live (nvme: a swap file under --nvme-path)",
    )
    parser.add_argument(
        "--offload-param",
        choices=["none", "cpu", "nvme"],
        default="none",
        help="stage 3: where the parameter shards live (nvme needs --offload-optimizer)",
    )
    parser.add_argument("--nvme-path", default="/var/tmp", help="directory for the NVMe swap")
    parser.add_argument(
        "--sub-group-size", type=int, default=1_000_000_000, help="elements per sub-group"
    )
    return parser.parse_args()


def batch(
    step: int, rank: int, world: int, args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of step ``step``."""
    g = torch.Generator().manual_seed(step)
    half = torch.randint(0, args.vocab, (args.global_batch, args.context // 2 + 1), generator=g)
    seq = torch.cat([half, half], dim=1)[:, : args.context + 1]
    local = args.global_batch // world
    seq = seq[rank * local : (rank + 1) * local].to(device)
    return seq[:, :-1], seq[:, 1:]  # predict the next token


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")
    )
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(
            f"--global-batch {args.global_batch} must be divisible by the world size {world}"
        )
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if use_cuda
        else torch.device("cpu")
    )
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.depth, args.heads, args.context).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    # Stage 3 gathers each transformer block as one unit (the embeddings, final
    # norm and head are units of their own).
    stage3 = {"module": model, "unit_classes": (Block,)} if args.stage == 3 else {}
    offload: dict = {"device": args.offload_optimizer}
    if args.offload_optimizer == "nvme":
        offload["nvme_path"] = args.nvme_path
    # max_in_cpu 0: every shard on disk (DeepSpeed's default keeps 1e9 elements in RAM).
    offload_param: dict = {"device": args.offload_param}
    if args.offload_param == "nvme":
        offload_param.update(nvme_path=args.nvme_path, max_in_cpu=0)
    optimizer = zeroshard.ZeroOptimizer(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        optimizer=args.optimizer,
        stage=args.stage,
        lr=args.lr,
        offload_optimizer=offload,
        offload_param=offload_param if args.stage == 3 else None,
        sub_group_size=args.sub_group_size,
        **stage3,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )

    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(
            f"GPT: {n_params / 1e6:.2f}M parameters, {world} ranks "
            f"({'NCCL' if use_cuda else 'Gloo/CPU'}), ZeRO stage {args.stage}, "
            f"{args.optimizer}",
            flush=True,
        )
    for step in range(args.steps):
        tokens, targets = batch(step, rank, world, args, device)
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        if use_cuda:
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) * 1e3
        if step % args.print_every == 0 or step == args.steps - 1:
            # Per-rank figures: loss, step time, optimizer state (1/N each), and
            # peak device memory (GPU) or peak process RSS (CPU), in MiB.
            peak = torch.cuda.max_memory_allocated() if use_cuda else rss_mib() * 2**20
            mine = torch.tensor(
                [loss.item(), step_ms, optimizer.optimizer_state_bytes() / 2**20, peak / 2**20],
                dtype=torch.float64,
                device=device,
            )
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
            if rank == 0:
                rows = torch.stack(everyone).cpu()
                memory = " ".join(f"r{r}:{rows[r, 2]:.3f}/{rows[r, 3]:.0f}" for r in range(world))
                print(
                    f"step {step:4d} loss {rows[:, 0].mean():.4f} "
                    f"lr {scheduler.get_last_lr()[0]:.2e} step_ms {rows[:, 1].max():.1f} "
                    f"mem[optimizer_state/{'cuda_peak' if use_cuda else 'rss_peak'} MiB] "
                    f"{memory}",
                    flush=True,
                )
    # Drop what holds the process group (the optimizer, and at stage 3 the
    # model, whose hooks keep the optimizer, and every other reference to the
    # model: the stage 3 keyword arguments) before destroying the group, so
    # that destroy_process_group() frees it and joins Gloo's threads now
    # rather than at interpreter exit (NCCL: the optimizer must not outlive
    # its communicator).
    del scheduler, optimizer, model, stage3
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
