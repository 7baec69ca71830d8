"""Runs a function on W ranks, each a fresh process joined by a Gloo group.

Results come back to the parent in rank order; an exception on a rank comes
back as a ``RankError`` carrying its type and message, so tests can assert
that every rank raised. A run that does not finish in time is a hang: the
processes are killed and the test fails.

Rank processes fork from a multiprocessing fork server that has imported
torch and torch._dynamo once: a spawned rank spends 3-4 s of CPU importing
them, which was about half of the suite's time on two cores. (Python 3.11's
fork server ignores the test's ``sys.path`` when it preloads, so zeroshard,
~50 ms, is imported by each rank.) The server runs no torch operation, so no
thread pool or process group crosses the fork, and each rank is still a new
process with its own state. Two things a forked rank does not get from the
test, and the harness gives it: the test's stdout and stderr (pytest's capture
files), passed as file descriptors; and the test's environment, copied into
the rank. Variables read when a process or a library starts (glibc's
``MALLOC_*``, the loader's, OpenMP's and the BLAS libraries', Python's,
torch's) cannot be changed that late: where the test has changed one, its
ranks are spawned instead.

A forked rank ends with ``os._exit``: its atexit handlers do not run (a
spawned one's do). The library's exit paths are tested on real processes
(``test_exit.py``, torchrun), not through this harness.
"""

from __future__ import annotations

import ctypes
import datetime
import io
import os
import queue
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server, inherited by every rank forked from it.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


# Read when a process or a library starts: a change to one after the fork
# server started needs a spawned rank.
# Not TORCHINDUCTOR_* nor PYTORCH_*: torch sets inductor's cache directory in
# the test process on first use, and importing deepspeed sets
# PYTORCH_NVML_BASED_CUDA_CHECK; neither changes what a CPU rank does, and
# counting them would spawn every later test's ranks.
_START_VARIABLE_PREFIXES = (
    *("MALLOC_", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "PYTHON"),
    *("TORCH_", "TORCHDYNAMO_"),
)
_ENVIRONMENT_AT_IMPORT = dict(os.environ)  # the fork server's: it starts later, unchanged


@dataclass
class RankError:
    """An exception raised on one rank."""

    type_name: str
    message: str
    traceback: str


class _InheritedFd:
    """A file descriptor of the test process, duplicated into the rank process.

    Pickled while the process starts, so multiprocessing passes the descriptor
    itself (over the fork server's socket, or to the spawned child).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[..., int], tuple[Any]]:
        return _detach_fd, (reduction.DupFd(self.fd),)


def _detach_fd(duplicate: Any) -> int:
    return duplicate.detach()


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    output_fds: tuple[int, int],
    environment: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environment)
    # Write where the test's own output goes now (pytest may be capturing it).
    for target, fd in zip((1, 2), output_fds, strict=True):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    torch.set_num_threads(1)
    try:
        # The harness's own store (public API), so the join barrier below can
        # use it: init_process_group keeps its keys under a prefix of its own.
        store = dist.FileStore(init_file, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        _wait_until_every_rank_joined(store, rank, world_size)
        value: Any = fn(rank, world_size, *args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        value = RankError(type(error).__name__, str(error), traceback.format_exc())
    # Tensors travel by value: shared-memory handles would die with this process.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    results.put((rank, buffer.getvalue()))
    if dist.is_initialized():
        dist.destroy_process_group()
    # os._exit follows (a forked rank): what C++ printed must not stay buffered.
    ctypes.CDLL(None).fflush(None)


def _wait_until_every_rank_joined(store: dist.Store, rank: int, world_size: int) -> None:
    """Returns once every rank's default group is set up.

    Gloo's connectFullMesh can return on one rank while a peer is still
    connecting. A test function that raises before any collective (a config
    error) then destroys its group and closes the pairs that peer is still
    connecting: "Connection closed by peer" in the peer's init_process_group,
    seen once in a full run (test_engine's config-error test). A store
    barrier keeps every rank's group alive until all are connected.
    """
    store.set(f"dist_harness/joined/{rank}", "1")
    store.wait(
        [f"dist_harness/joined/{r}" for r in range(world_size)], datetime.timedelta(seconds=60)
    )


def _rank_context() -> Any:
    """The fork server's context, or spawn's where a start-time variable has changed.

    ``ZEROSHARD_TEST_START_METHOD=spawn`` spawns every rank, as before the
    fork server.
    """
    changed = {
        k
        for k in set(os.environ) | set(_ENVIRONMENT_AT_IMPORT)
        if os.environ.get(k) != _ENVIRONMENT_AT_IMPORT.get(k)
    }
    if os.environ.get("ZEROSHARD_TEST_START_METHOD") == "spawn":
        return mp.get_context("spawn")
    read_at_start = sorted(k for k in changed if k.startswith(_START_VARIABLE_PREFIXES))
    if read_at_start:
        # Not silent: a spawned rank costs seconds (pytest lists the warning).
        warnings.warn(
            f"dist_harness: spawning the ranks, the environment changed {read_at_start}",
            stacklevel=3,
        )
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


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
    ctx = _rank_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world_size,
                    init_file,
                    fn,
                    args,
                    results,
                    (_InheritedFd(1), _InheritedFd(2)),
                    dict(os.environ),
                ),
            )
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
