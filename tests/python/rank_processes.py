"""Rank programs as real processes (env:// rendezvous): exit codes and output.

The in-process harness (dist_harness.py) cannot see how a process ends: an
exit code, an abort at interpreter exit, a signal. These helpers start one
process per rank running a script and return each one's exit code and output.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_processes(
    script: str,
    args: list[str],
    world: int = 2,
    timeout: float = 120,
    extra_env: dict[str, str] | None = None,
    waited: int | None = None,
) -> list[tuple[int, str]]:
    """Runs ``script args`` on ``world`` ranks; (exit code, output) per rank.

    With ``waited``, only the first ``waited`` ranks are waited for; the rest
    are killed once those exited (a stalled rank).
    """
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
            **(extra_env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    for proc in procs[:waited]:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{args} did not exit within {timeout}s (hang)") from None
        results.append((proc.returncode, out))
    for proc in procs[len(results) :]:
        proc.kill()
        proc.communicate()
    return results


def last_json(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"no result line in:\n{output}"
    return json.loads(lines[-1])
