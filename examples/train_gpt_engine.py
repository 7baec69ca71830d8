"""Trains the example GPT through ``zeroshard.initialize`` and a DeepSpeed config.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt_engine.py \\
        --config examples/ds_config.json --steps 100

The loop is the one DeepSpeed users write (engine(x), engine.backward(loss),
engine.step()); rank 0 shows a progress bar, and the engine prints a telemetry
line every ``steps_per_print`` steps (also appended as JSON to the config's
``zeroshard.telemetry_file``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import zeroshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, Block  # noqa: E402


def progress(step: int, total: int, loss: float, lr: float) -> None:
    width = 30
    done = width * step // total
    bar = "#" * done + "." * (width - done)
    end = "\n" if step == total else ""
    print(f"\r[{bar}] {step}/{total} loss {loss:.4f} lr {lr:.2e}", end=end, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--config", default=os.path.join(os.path.dirname(__file__), "ds_config.json")
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--context", type=int, default=32)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(args.vocab, 64, 2, 4, args.context)
    with open(args.config) as f:
        precision = json.load(f)
    # The model is built in the training dtype; the engine keeps fp32 masters.
    if precision.get("bf16", {}).get("enabled"):
        model.to(torch.bfloat16)
    elif precision.get("fp16", {}).get("enabled"):
        model.to(torch.float16)
    engine, _, _, scheduler = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=args.config, unit_classes=(Block,)
    )
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps):
        for m in range(engine.gradient_accumulation_steps()):
            g = torch.Generator().manual_seed(step * 100 + m)
            half = torch.randint(0, args.vocab, (micro * world, args.context // 2 + 1), generator=g)
            seq = torch.cat([half, half], dim=1)[rank * micro : (rank + 1) * micro]
            seq = seq[:, : args.context + 1]
            logits = engine(seq[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.float().reshape(-1, args.vocab), seq[:, 1:].reshape(-1)
            )
            engine.backward(loss)
            engine.step()
        if rank == 0 and not os.environ.get("ZEROSHARD_NO_PROGRESS"):
            progress(step + 1, args.steps, loss.item(), engine.get_lr()[0])
    # Everything that holds the engine's optimizer, and through it the process
    # group: the scheduler, and at stage 3 the model, whose hooks hold it.
    del engine, scheduler, model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
