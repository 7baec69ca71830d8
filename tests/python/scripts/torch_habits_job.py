"""A training script's habits as a rank program, for test_torch_habits.py.

    python torch_habits_job.py clip STAGE      # torch's clip_grad_norm_, imported
        # before zeroshard as scripts do; prints the norms and the weights' sum
    python torch_habits_job.py lr_per_rank     # rank r builds with lr (r + 1) * 1e-3:
        # the construction's error ends the process (exit code 1)

Run with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (env:// rendezvous).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import clip_grad_norm_  # before zeroshard: the name scripts hold

import zeroshard


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    if sys.argv[1] == "lr_per_rank":
        zeroshard.ZeroOptimizer(model.parameters(), lr=1e-3 * (rank + 1))
        raise AssertionError("construction accepted a different lr on each rank")
    stage = int(sys.argv[2])
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), stage=stage, module=model, lr=0.05)
    norms = []
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(4 * world, 4, generator=generator)[rank * 4 : (rank + 1) * 4] * 3
        nn.functional.mse_loss(model(x), torch.ones(4, 3)).backward()
        norms.append(float(clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
    with optimizer.gathered_parameters():
        total = sum(float(p.double().sum()) for p in model.parameters())
    print(json.dumps({"norms": norms, "weights": total}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
