"""zeroshard.integrations.accelerate.prepare in a real Accelerate loop.

tests/python/scripts/accelerate_job.py under torchrun (2 CPU ranks, Gloo):
the tiny GPT-2 of the Trainer test, AdamW, accumulation through
``accelerator.accumulate``, clipping through ``accelerator.clip_grad_norm_``
at the boundary. The yardstick is torch.optim.AdamW with accelerate's DDP on
the same ranks: both differ from one process by the per-rank loss means and
the clip's norm rounding, amplified by Adam (1.05e-5 each when this was
written). zeroshard must be no further than DDP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from rank_processes import free_port  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "accelerate_job.py")


def _job(out: Path, *args: str, world: int | None = 2) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    launcher = (
        [sys.executable, JOB]
        if world is None
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={world}",
            f"--master_port={free_port()}",
            JOB,
        ]
    )
    proc = subprocess.run(
        [*launcher, str(out), *args],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"{args} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    )
    result = json.loads((out / "result.json").read_text())
    result["params"] = torch.load(out / "params.pt")
    return result


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _job(tmp_path_factory.mktemp("single"), "--optimizer", "torch", world=None)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _job(tmp_path_factory.mktemp("ddp"), "--optimizer", "torch")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_prepare_trains_as_ddp_does(stage: int, tmp_path: Path, reference: dict, ddp: dict) -> None:
    result = _job(tmp_path, "--optimizer", "zero", "--stage", str(stage))
    ddp_diff = _diff(ddp["params"], reference["params"])
    zero_diff = _diff(result["params"], reference["params"])
    print(f"stage {stage}: zeroshard {zero_diff:.3e} from single-process; DDP {ddp_diff:.3e}")
    assert ddp["wrapped"] == "DistributedDataParallel"
    assert result["wrapped"] == "GPT2LMHeadModel"  # no DDP
    assert zero_diff <= ddp_diff, (zero_diff, ddp_diff)
    assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert all(n > 0.1 for n in result["norms"])  # clip_grad_norm_ saw the gradients


def test_save_state_load_state_round_trip(tmp_path: Path) -> None:
    straight = _job(tmp_path / "straight", "--optimizer", "zero", "--save-at", "2")
    state = tmp_path / "straight" / "state"
    assert (state / "zeroshard" / "index.json").is_file()
    resumed = _job(
        tmp_path / "resumed",
        "--optimizer",
        "zero",
        "--save-at",
        "2",
        "--resume",
        str(state),
    )
    assert resumed["norms"] == straight["norms"][2:]
    assert _diff(resumed["params"], straight["params"]) == 0.0
    # Resharded: one rank at stage 3 loads the 2-rank stage-2 state.
    other = _job(
        tmp_path / "world1",
        "--optimizer",
        "zero",
        "--stage",
        "3",
        "--save-at",
        "2",
        "--resume",
        str(state),
        world=1,
    )
    diff = _diff(other["params"], straight["params"])
    print(f"resumed on 1 rank at stage 3: {diff:.3e}")
    assert diff <= 1e-5, diff  # reduction order only (see the module docstring)


def test_the_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    example = os.path.join(os.path.dirname(JOB), "..", "..", "..", "examples", "accelerate_gpt2.py")
    root = os.path.join(os.path.dirname(JOB), "..", "..", "..", "python")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    for extra in ([], ["--resume"]):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             f"--master_port={free_port()}", example, "--stage", "3", "--steps", "5",
             "--state-dir", str(tmp_path / "state"), *extra],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, f"{extra}:\n{proc.stdout}\n{proc.stderr}"
        assert "step 5 loss" in proc.stdout, proc.stdout
    assert (tmp_path / "state" / "zeroshard" / "index.json").is_file()
