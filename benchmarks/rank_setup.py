"""What every benchmark rank does first: the environment torchrun would set and a Gloo group.

The benchmarks start their ranks with multiprocessing (spawn), not torchrun,
so they set what torchrun would: DeepSpeed reads its rank and accelerator
from the environment even when the process group already exists.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def join_gloo_group(
    rank: int,
    world: int,
    init_file: str,
    *,
    threads: int | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Sets torchrun's variables and the intra-op threads, then joins the Gloo group.

    ``threads`` defaults to this machine's cores divided among the ranks;
    ``timeout`` to c10d's default.
    """
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "DS_ACCELERATOR": "cpu",
        }
    )
    torch.set_num_threads(threads if threads else max(1, (os.cpu_count() or 2) // world))
    extra = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, **extra
    )
