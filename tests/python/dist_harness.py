"""Runs a function on W ranks, each a spawned process joined by a Gloo group.

Results come back to the parent in rank order; an exception on a rank comes
back as a ``RankError`` carrying its type and message, so tests can assert
that every rank raised. A run that does not finish in time is a hang: the
processes are killed and the test fails.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class RankError:
    """An exception raised on one rank."""

    type_name: str
    message: str
    traceback: str


def _worker(
    rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple, results: Any
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        value: Any = fn(rank, world_size, *args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        value = RankError(type(error).__name__, str(error), traceback.format_exc())
    # Tensors travel by value: shared-memory handles would die with this process.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    results.put((rank, buffer.getvalue()))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 180.0,
    allow_killed: bool = False,
) -> list[Any]:
    """Calls ``fn(rank, world_size, *args)`` on every rank; returns results by rank.

    With ``allow_killed``, a rank process that dies without reporting (SIGKILL)
    gives ``"killed"`` instead of failing the run as a hang.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        collected: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(collected) < world_size:
                if time.monotonic() > deadline:
                    raise queue.Empty
                try:
                    rank, payload = results.get(timeout=1.0)
                except queue.Empty:
                    if allow_killed:
                        for r, p in enumerate(procs):
                            if r not in collected and p.exitcode is not None and p.exitcode < 0:
                                collected[r] = "killed"
                    continue
                collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        except queue.Empty:
            raise AssertionError(
                f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish "
                f"within {timeout}s (hang)"
            ) from None
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [collected[r] for r in range(world_size)]


def unwrap(results: list[Any]) -> list[Any]:
    """Fails the test with the rank's traceback if any rank raised."""
    for rank, value in enumerate(results):
        if isinstance(value, RankError):
            raise AssertionError(
                f"rank {rank} raised {value.type_name}: {value.message}\n{value.traceback}"
            )
    return results
