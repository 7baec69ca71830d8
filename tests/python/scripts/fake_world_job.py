"""One process as the last rank of W, through torch's fake process group:
construction, two steps at stages 1-3, and what this rank holds.

    python fake_world_job.py W OUT.json

Collectives return at once and move nothing (values are garbage), so what
this measures is sizes, memory and code paths at a world size no CPU machine
could run: shard sizes, bytes per rank against the estimator, host syncs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "python"))

import zeroshard  # noqa: E402

WIDTH = 256  # 4 square layers and a 37-wide head: ~0.27M parameters, one odd size


def model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 37)).to(torch.bfloat16)


def main() -> None:
    world, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    rank = world - 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    rows = []
    for stage in (1, 2, 3):
        net = model()
        extra = {"module": net, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
        optimizer = zeroshard.ZeroOptimizer(net.parameters(), "adamw", stage=stage, **extra)
        x = torch.randn(4, WIDTH, dtype=torch.bfloat16)
        syncs = []
        for _ in range(3):
            before = sum(optimizer.host_sync_counts().values())
            optimizer.zero_grad()
            net(x).float().pow(2).mean().backward()
            grads = optimizer.gradient_bytes()
            optimizer.step()
            syncs.append(sum(optimizer.host_sync_counts().values()) - before)
        groups = len(optimizer.param_groups)
        rows.append(
            {
                "stage": stage,
                "world": world,
                "rank": optimizer._impl.rank,
                "num_params": sum(p.numel() for p in net.parameters()),
                "shard_numel": [optimizer._impl.shard_numel(g) for g in range(groups)],
                "flat_numel": [optimizer._impl.flat_numel(g) for g in range(groups)],
                "optimizer_state_bytes": optimizer.optimizer_state_bytes(),
                "model_state_bytes": optimizer.parameter_bytes()
                + grads
                + optimizer.optimizer_state_bytes(),
                "host_syncs_per_step": syncs,
            }
        )
    Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
