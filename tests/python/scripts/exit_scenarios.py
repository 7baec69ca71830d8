"""Rank programs for test_exit.py: each ends the way a training script does.

    python exit_scenarios.py threads STAGE   # prints the threads left after destroy
    python exit_scenarios.py late            # a collective still running at exit
    python exit_scenarios.py leaky STAGE     # keeps model and optimizer past destroy;
        # prints the threads after destroy and at exit (after zeroshard's handler)
    python exit_scenarios.py leaky_tp STAGE|none  # the same with tensor parallelism
        # (a 1 x WORLD_SIZE device mesh, DTensor parameters); 'none': the
        # model alone, trained with torch.optim.SGD instead of zeroshard
    python exit_scenarios.py example SCRIPT ARGS...  # examples/SCRIPT ARGS; prints
        # the threads left right after its own destroy_process_group()
    python exit_scenarios.py fault kill|stall STAGE
        # the last rank is killed (SIGKILL) or stalls after step 2's forward;
        # the others print the error they got and exit with code 3
    python exit_scenarios.py calls alone|extra STAGE
        # every rank alive, in different calls: 'alone': rank 0 calls
        # full_state_dict() after step 2 and the others do not; 'extra': rank 0
        # takes a third step while the others save a checkpoint. Each rank
        # prints the error it got and exits with code 3

Run with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (env:// rendezvous).
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:
            pass  # a thread that ended between the listing and the read
    return sorted(names)


if sys.argv[1:2] in (["leaky"], ["leaky_tp"]):
    # Registered before zeroshard is imported, so it runs after zeroshard's
    # own exit handler (atexit runs handlers last-in, first-out).
    def report_threads_at_exit() -> None:
        print(json.dumps({"threads_at_exit": thread_names()}), flush=True)
        if sys.argv[1] == "leaky_tp":
            # What is measured is printed. The C++ teardown after this point
            # destroys the device mesh's groups that torch's DTensor keeps,
            # and that aborted once ("terminate called without an active
            # exception", exit -6) with torch.optim alone, no zeroshard
            # optimizer in the process: torch's teardown, not under test.
            # The plain 'leaky' scenario still exits through it.
            os._exit(0)

    atexit.register(report_threads_at_exit)

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "python")
)
import zeroshard  # noqa: E402

KEPT: list = []  # what a leaky script keeps to the end


def report_error(rank: int, error: Exception, started: float) -> None:
    """Prints the error (and how long after `started` it came) for the test; exits 3."""
    print(
        json.dumps(
            {
                "rank": rank,
                "error": f"{type(error).__name__}: {error}",
                "seconds": time.monotonic() - started,
            }
        ),
        flush=True,
    )
    raise SystemExit(3) from None


def train_briefly(stage: int) -> tuple[nn.Module, zeroshard.ZeroOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    extra = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), stage=stage, lr=1e-2, **extra)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def run_example(script: str, argv: list[str]) -> None:
    """Runs an example script as torchrun would, and reports the threads
    left right after the script's own ``destroy_process_group()``: a Gloo
    worker thread still running there means something the script kept alive
    (the optimizer, through the model's stage 3 hooks) still holds the group."""
    import runpy

    example = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", script
    )
    left: dict[str, list[str]] = {}
    destroy = dist.destroy_process_group

    def destroy_and_look(*args, **kwargs):
        destroy(*args, **kwargs)
        left["threads"] = thread_names()

    dist.destroy_process_group = destroy_and_look
    sys.argv = [example, *argv]
    runpy.run_path(example, run_name="__main__")
    print(json.dumps({"rank": int(os.environ["RANK"]), "threads": left["threads"]}), flush=True)


def fault(kind: str, stage: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    extra = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), stage=stage, lr=1e-2, reduce_bucket_size=64, **extra
    )
    started = time.monotonic()
    try:
        for step in range(5):
            optimizer.zero_grad()
            loss = model(torch.randn(4, 8)).square().mean()
            if step == 2 and kind == "raise":
                # The last rank's own error: it exits. The others meet the
                # failure in a collective outside step(): full_state_dict().
                if rank == world - 1:
                    raise ValueError("this rank's own error")
                optimizer.full_state_dict()
            if step == 2 and rank == world - 1:
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(120)  # stalls: the test kills it once the others are done
            started = time.monotonic()
            loss.backward()
            optimizer.step()
    except Exception as error:  # noqa: BLE001 - reported to the test
        report_error(rank, error, started)
    print(json.dumps({"rank": rank, "error": None}), flush=True)


def different_calls(kind: str, stage: int) -> None:
    import tempfile

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    extra = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), stage=stage, lr=1e-2, **extra)
    started = time.monotonic()
    try:
        for step in range(3):
            if step == 2 and kind == "extra" and rank != 0:
                break  # rank 0 alone takes this step
            optimizer.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step()
            if step == 1 and kind == "alone" and rank == 0:
                started = time.monotonic()
                optimizer.full_state_dict()
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as directory:
            optimizer.save_checkpoint(os.path.join(directory, "checkpoint"))
    except Exception as error:  # noqa: BLE001 - reported to the test
        report_error(rank, error, started)
    print(json.dumps({"rank": rank, "error": None}), flush=True)


def train_briefly_tensor_parallel(stage: int | None) -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    extra = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=1e-2)
        if stage is None
        else zeroshard.ZeroOptimizer(
            model.parameters(), stage=stage, lr=1e-2, device_mesh=mesh["dp"], **extra
        )
    )
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
    return model, optimizer  # the mesh is dropped here, as a script's local


def main() -> None:
    if sys.argv[1] == "example":
        run_example(sys.argv[2], sys.argv[3:])
        return
    torch.set_num_threads(1)
    timeout = float(os.environ.get("PG_TIMEOUT_SECONDS", "60"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    if sys.argv[1] == "fault":
        fault(sys.argv[2], int(sys.argv[3]))
        return
    if sys.argv[1] == "calls":
        different_calls(sys.argv[2], int(sys.argv[3]))
        return
    if sys.argv[1] == "threads":
        model, optimizer = train_briefly(int(sys.argv[2]))
        del model, optimizer
        dist.destroy_process_group()
        print(json.dumps({"rank": rank, "threads": thread_names()}), flush=True)
    elif sys.argv[1] in ("leaky", "leaky_tp"):
        if sys.argv[1] == "leaky":
            KEPT.extend(train_briefly(int(sys.argv[2])))
        else:
            stage = None if sys.argv[2] == "none" else int(sys.argv[2])
            KEPT.extend(train_briefly_tensor_parallel(stage))
        dist.destroy_process_group()
        print(json.dumps({"rank": rank, "threads": thread_names()}), flush=True)
    elif sys.argv[1] == "late":
        model, optimizer = train_briefly(2)
        del model, optimizer
        # Rank 0 leaves a collective in flight that rank 1 joins a second
        # later, after rank 0 has destroyed the group and begun to exit: the
        # Work holds the only reference to a Python-owned tensor.
        if rank == 1:
            time.sleep(float(os.environ.get("LATE_DELAY", "1.0")))
        mine = torch.ones(4)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        work = dist.all_gather(everyone, mine, async_op=True)
        if rank == 1:
            work.wait()
        del work, mine, everyone
        dist.destroy_process_group()
        print(json.dumps({"rank": rank, "threads": thread_names()}), flush=True)
    else:
        raise SystemExit(f"unknown scenario {sys.argv[1]!r}")


if __name__ == "__main__":
    main()
