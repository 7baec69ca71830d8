"""Where a torch.optim class's step goes when zeroshard runs it (TorchOptimizerRule).

One rank (Gloo, world size 1) trains the benchmark GPT with ``ZeroOptimizer(...,
torch.optim.RAdam)`` at stage 2 and prints a cProfile of ten steps, sorted by
cumulative time: ``zeroshard/update_rules.py:update`` is the rule's Python,
``torch/optim/...:_use_grad`` torch's own step inside it.

    python benchmarks/profile_rule_step.py [--width 256] [--optimizer RAdam]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import zeroshard  # noqa: E402
from train_gpt import GPT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--optimizer", default="RAdam", help="a torch.optim class name")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.depth, 4, 64)
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), getattr(torch.optim, args.optimizer), lr=1e-3, stage=2
    )
    tokens = torch.randint(0, args.vocab, (4, 65))

    def step() -> None:
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    print(f"{(time.perf_counter() - start) * 1000 / args.steps:.1f} ms per training step")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(20)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
