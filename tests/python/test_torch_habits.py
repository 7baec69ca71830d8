"""Habits of torch training scripts that must not give silent wrong answers.

Each case trains zeroshard and the yardstick, ``DistributedDataParallel`` +
``torch.optim.AdamW``, on the same ranks and batches (issue #49):

- ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` between
  backward and step: returns the global norm DDP returns and clips as DDP
  does, at every stage (at stages 2-3 ``.grad`` is released after backward,
  at stage 1 it holds this rank's unreduced gradient: torch's own helper
  would see nothing, or each rank's local norm);
- a parameter built frozen and unfrozen after two steps trains from then on
  (DDP leaves out of its buckets a parameter frozen when it was wrapped, so
  there each rank steps it with its own local gradient and the ranks drift
  apart; the yardstick is single-process torch.optim on the global batch);
- a buffer initialised differently on each rank is rank 0's everywhere once
  the optimizer knows the module, as DDP broadcasts it at construction;
- ranks whose hyper-parameters or options differ raise on every rank, naming
  what differs and each rank's value, at construction or at the step a
  difference appears.

Every rank's weights are compared with each other and with the yardstick:
reduction order differs (DDP all-reduces, zeroshard reduce-scatters), so the
bound is 1e-6, the distance at which two correct reductions of these sums
agree, and the tests print the measured distances.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from rank_processes import last_json, run_rank_processes

STEPS = 5
GLOBAL_BATCH = 12
TOLERANCE = 1e-6


class Net(nn.Module):
    """Two linear layers, a parameter of the root (``extra``) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.extra = nn.Parameter(torch.full((3,), 0.5))
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x + self.shift))) + self.extra * x[:, :3]


def _model(rank: int, case: str) -> Net:
    torch.manual_seed(0)
    model = Net()
    if case == "unfreeze":
        model.extra.requires_grad_(False)
    if case == "buffer":
        # An unseeded random initialisation: each rank draws its own.
        generator = torch.Generator().manual_seed(100 + rank)
        model.shift.copy_(torch.randn(4, generator=generator))
    return model


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=generator) * 3
    y = torch.randn(GLOBAL_BATCH, 3, generator=generator)
    if rank < 0:  # single process: the whole global batch
        return x, y
    per_rank = GLOBAL_BATCH // world
    return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]


def _train(rank: int, world: int, kind: str, case: str, stage: int) -> dict[str, Any]:
    """Trains ``STEPS`` steps; returns every parameter and buffer and the clip norms.

    kind: "zero" (ZeroOptimizer at ``stage`` with module=), "ddp" (DDP +
    torch.optim.AdamW) or "single" (one process on the global batch, rank 0).
    """
    model = _model(rank, case)
    if kind == "zero":
        optimizer: Any = zeroshard.ZeroOptimizer(
            model.parameters(), "adamw", stage=stage, module=model, lr=0.05
        )
        wrapped: nn.Module = model
    elif kind == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    else:
        wrapped = model
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    norms = []
    moved_while_frozen = 0.0
    for step in range(STEPS):
        if case == "unfreeze" and step == 2:
            model.extra.requires_grad_(True)
        x, y = _batch(step, rank if kind != "single" else -1, world)
        before = _extra(model, optimizer, kind)
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        if case == "clip":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        if case == "unfreeze" and step < 2:
            moved_while_frozen += float((_extra(model, optimizer, kind) - before).abs().max())
    if kind == "zero" and stage == 3:
        with optimizer.gathered_parameters():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return {
        "params": params,
        "buffers": buffers,
        "norms": norms,
        "moved_while_frozen": moved_while_frozen,
    }


def _extra(model: Net, optimizer: Any, kind: str) -> torch.Tensor:
    if kind == "zero" and optimizer._stage == 3:
        with optimizer.gathered_parameters([model.extra]):
            return model.extra.detach().clone()
    return model.extra.detach().clone()


def _single(case: str) -> dict[str, Any]:
    return _train(-1, 1, "single", case, 0)


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _same_on_every_rank(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results[1:], start=1):
        assert _distance(result["params"], results[0]["params"]) == 0.0, rank
        assert _distance(result["buffers"], results[0]["buffers"]) == 0.0, rank


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_clip_grad_norm_clips_by_the_global_norm(stage: int) -> None:
    world = 2
    zero = unwrap(run_ranks(world, _train, "zero", "clip", stage))
    ddp = unwrap(run_ranks(world, _train, "ddp", "clip", 0))
    _same_on_every_rank(zero)
    _same_on_every_rank(ddp)
    unclipped = unwrap(run_ranks(world, _train, "ddp", "none", 0))
    clip_effect = _distance(unclipped[0]["params"], ddp[0]["params"])
    diff = _distance(zero[0]["params"], ddp[0]["params"])
    print(
        f"stage {stage}: norms zeroshard {zero[0]['norms']}, DDP {ddp[0]['norms']}; "
        f"weights {diff:.3e} from DDP + clip (clipping moves DDP by {clip_effect:.3e})"
    )
    assert clip_effect > 1e-2  # the clip matters: a no-op would fail below
    for rank in range(world):
        assert zero[rank]["norms"] == pytest.approx(ddp[0]["norms"], rel=1e-6)
    assert min(ddp[0]["norms"]) > 1.0  # every step clips
    assert diff <= TOLERANCE


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_unfrozen_mid_training_trains(stage: int) -> None:
    world = 2
    zero = unwrap(run_ranks(world, _train, "zero", "unfreeze", stage))
    _same_on_every_rank(zero)
    single = _single("unfreeze")
    diff = _distance(zero[0]["params"], single["params"])
    moved = float((single["params"]["extra"] - 0.5).abs().max())
    print(f"stage {stage}: {diff:.3e} from single-process; extra moved {moved:.4f} there")
    assert zero[0]["moved_while_frozen"] == 0.0
    assert moved > 1e-2
    assert diff <= TOLERANCE


def test_ddp_leaves_a_parameter_unfrozen_after_wrapping_unsynchronized() -> None:
    # Why single-process is the yardstick of the unfreeze test: DDP's buckets
    # are fixed when it wraps the model, so the ranks step the unfrozen
    # parameter with their own gradients and disagree.
    ddp = unwrap(run_ranks(2, _train, "ddp", "unfreeze", 0))
    gap = float((ddp[0]["params"]["extra"] - ddp[1]["params"]["extra"]).abs().max())
    print(f"DDP: the ranks' unfrozen parameter differs by {gap:.3e}")
    assert gap > 1e-3


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_buffers_are_rank_zeros_when_the_module_is_known(stage: int) -> None:
    world = 2
    zero = unwrap(run_ranks(world, _train, "zero", "buffer", stage))
    ddp = unwrap(run_ranks(world, _train, "ddp", "buffer", 0))
    _same_on_every_rank(zero)
    _same_on_every_rank(ddp)
    rank0 = _model(0, "buffer").shift
    assert torch.equal(zero[0]["buffers"]["shift"], rank0)
    diff = _distance(zero[0]["params"], ddp[0]["params"])
    print(f"stage {stage}: {diff:.3e} from DDP")
    assert diff <= TOLERANCE


# Cross-rank mismatches -----------------------------------------------------------


def _mismatch(rank: int, world: int, case: str) -> dict[str, Any]:
    """One mismatch scenario; the error (type, message) and whether the group
    still works afterwards (no rank was left inside a collective)."""
    torch.manual_seed(0)
    model = Net()
    outcome: tuple[str, str] = ("no error", "")
    try:
        if case == "lr_at_construction":
            zeroshard.ZeroOptimizer(model.parameters(), lr=1e-3 * (rank + 1), stage=2)
        elif case == "eps_of_group_1":
            groups = [
                {"params": list(model.fc1.parameters())},
                {"params": [model.extra, *model.fc2.parameters()], "eps": 1e-8 * (rank + 1)},
            ]
            zeroshard.ZeroOptimizer(groups, stage=1)
        elif case == "betas":
            zeroshard.ZeroOptimizer(model.parameters(), betas=(0.9, 0.99 if rank == 0 else 0.95))
        elif case == "stage":
            zeroshard.ZeroOptimizer(model.parameters(), stage=2 + rank, module=model)
        elif case == "reduce_bucket_size":
            zeroshard.ZeroOptimizer(model.parameters(), reduce_bucket_size=100 + rank)
        elif case in ("lr_at_step", "scheduler"):
            optimizer = zeroshard.ZeroOptimizer(model.parameters(), lr=1e-3, stage=2)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            for step in range(3):
                x, y = _batch(step, rank, world)
                nn.functional.mse_loss(model(x), y).backward()
                if case == "lr_at_step" and step == 2 and rank == 1:
                    optimizer.param_groups[0]["lr"] = 2e-3
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
    except Exception as error:  # noqa: BLE001 - recorded for the assertions
        outcome = (type(error).__name__, str(error))
    alive = torch.ones(1)
    dist.all_reduce(alive)
    return {"outcome": outcome, "group_works": alive.item() == world}


MISMATCHES = {
    "lr_at_construction": ["group 0", "lr", "0.001", "0.002"],
    "eps_of_group_1": ["group 1 eps", "1e-08", "2e-08"],
    "betas": ["group 0 betas", "[0.9,0.99]", "[0.9,0.95]"],
    "stage": ["stage", "2", "3"],
    "reduce_bucket_size": ["reduce_bucket_size", "100", "101"],
    "lr_at_step": ["group 0", "lr", "0.00025", "0.002"],
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_difference_between_ranks_raises_on_every_rank_naming_it(case: str) -> None:
    results = unwrap(run_ranks(2, _mismatch, case))
    for rank, result in enumerate(results):
        error_type, message = result["outcome"]
        print(f"rank {rank}: {error_type}: {message}")
        assert error_type in ("RuntimeError", "ValueError"), (rank, error_type, message)
        for words in MISMATCHES[case]:
            assert words in message, (rank, words, message)
        assert "rank 0" in message and "rank 1" in message, message
        assert result["group_works"]


def test_a_scheduler_changing_lr_alike_is_not_a_difference() -> None:
    results = unwrap(run_ranks(2, _mismatch, "scheduler"))
    assert [r["outcome"] for r in results] == [("no error", "")] * 2


def test_three_ranks_one_different_at_a_step() -> None:
    # Rank 1 of 3 edits its lr: every rank raises, ranks 0 and 2 named together.
    results = unwrap(run_ranks(3, _mismatch, "lr_at_step"))
    for rank, result in enumerate(results):
        error_type, message = result["outcome"]
        print(f"rank {rank}: {error_type}: {message}")
        assert error_type == "ValueError", (rank, message)
        assert "rank 0 and rank 2: group 0 lr = 0.00025; rank 1: group 0 lr = 0.002" in message
        assert result["group_works"]


# Real processes: exit codes, and the name scripts import before zeroshard ----------

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "scripts", "torch_habits_job.py")
PYTHON_PATH = {"PYTHONPATH": os.path.join(HERE, "..", "..", "python")}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clip_grad_norm_imported_before_zeroshard_clips_every_rank_alike(stage: int) -> None:
    outcomes = run_rank_processes(JOB, ["clip", str(stage)], extra_env=PYTHON_PATH)
    results = []
    for rank, (code, out) in enumerate(outcomes):
        assert code == 0, f"rank {rank} exited with {code}:\n{out}"
        results.append(last_json(out))
    print(results)
    assert results[0] == results[1]
    assert min(results[0]["norms"]) > 1.0  # the global norm: torch's own saw 0 at stages 2-3


def test_a_different_lr_per_rank_ends_every_rank_with_an_error() -> None:
    for rank, (code, out) in enumerate(
        run_rank_processes(JOB, ["lr_per_rank"], extra_env=PYTHON_PATH)
    ):
        assert code == 1, f"rank {rank} exited with {code} (a signal is negative):\n{out}"
        assert "group 0 lr" in out and "rank 0" in out and "rank 1" in out, out


# torch's clip over what zeroshard cannot clip as torch would ------------------------


def _clip_calls(rank: int, world: int) -> dict[str, Any]:
    """Each call's outcome after one backward at stage 2: the type and message
    of its error, or the norm it returned."""
    torch.manual_seed(0)
    model = Net()
    other = nn.Linear(2, 2)  # no ZeroOptimizer holds it
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), stage=2, module=model)
    x, y = _batch(0, rank, world)
    nn.functional.mse_loss(model(x), y).backward()
    other(torch.ones(1, 2)).sum().backward()
    calls = {
        "some_of_the_parameters": lambda: torch.nn.utils.clip_grad_norm_(
            model.fc1.parameters(), 1.0
        ),
        "mixed_with_other_gradients": lambda: torch.nn.utils.clip_grad_norm_(
            [*model.parameters(), *other.parameters()], 1.0
        ),
        "inf_norm": lambda: torch.nn.utils.clip_grad_norm_(
            model.parameters(), 1.0, norm_type=float("inf")
        ),
        # Not zeroshard's: torch's own, unchanged.
        "another_model": lambda: torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9),
        "everything": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9),
    }
    outcomes: dict[str, Any] = {}
    for name, call in calls.items():
        try:
            outcomes[name] = ("norm", float(call()))
        except Exception as error:  # noqa: BLE001 - recorded for the assertions
            outcomes[name] = (type(error).__name__, str(error))
    outcomes["optimizer_norm"] = float(optimizer.clip_grad_norm_(1e9))
    other_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in other.parameters()]))
    outcomes["other_norm"] = float(other_norm)
    return outcomes


def test_torch_clip_refuses_what_it_cannot_clip_as_torch_and_leaves_the_rest_alone() -> None:
    for rank, outcomes in enumerate(unwrap(run_ranks(2, _clip_calls))):
        print(rank, outcomes)
        kind, message = outcomes["some_of_the_parameters"]
        assert kind == "ValueError" and "pass all of them" in message, message
        assert "fc2.weight" in message, message  # names what is missing
        kind, message = outcomes["mixed_with_other_gradients"]
        assert kind == "ValueError" and "2 parameter(s) with a gradient" in message, message
        kind, message = outcomes["inf_norm"]
        assert kind == "ValueError" and "norm_type=inf" in message, message
        assert outcomes["another_model"] == ("norm", pytest.approx(outcomes["other_norm"]))
        assert outcomes["everything"] == ("norm", outcomes["optimizer_norm"])
        assert outcomes["optimizer_norm"] > 0


# ---- a backward after the gradients were reduced ------------------------------------


def _backward_after_clip(
    rank: int, world: int, stage: int, extra: dict[str, Any]
) -> dict[str, Any]:
    model = _model(rank, "none")
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), "adamw", stage=stage, module=model, lr=0.05, **extra
    )
    x, y = _batch(0, rank, world)
    nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # reduces the gradients
    nn.functional.mse_loss(model(x), y).backward()  # too late: they are averaged
    error = ""
    try:
        optimizer.step()
    except RuntimeError as e:
        error = str(e)
    # zero_grad starts the step's gradients again; the next step is the
    # first step of a fresh run on the same batch.
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    if stage == 3:
        with optimizer.gathered_parameters():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"error": error, "params": params}


def _one_ddp_step(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = _model(rank, "none")
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = _batch(0, rank, world)
    nn.functional.mse_loss(ddp(x), y).backward()
    optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "stage,extra",
    [(1, {}), (1, {"stage1_reduce_in_backward": True}), (2, {}), (3, {})],
    ids=["stage1", "stage1-overlap", "stage2", "stage3"],
)
def test_a_backward_after_the_clip_raises_on_every_rank(stage: int, extra: dict) -> None:
    # Without the check the second backward's gradients were added, as sums,
    # onto the averaged shard (stages 2-3) or dropped (stage 1): a silent
    # wrong step. DDP would step clip(g1) + g2; zeroshard cannot, and says so.
    world = 2
    results = unwrap(run_ranks(world, _backward_after_clip, stage, extra))
    reference = unwrap(run_ranks(world, _one_ddp_step))[0]
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result['error'][:120]}")
        assert "after the gradients were reduced" in result["error"], (rank, result["error"])
        assert "zero_grad()" in result["error"]
    for rank, result in enumerate(results[1:], start=1):
        assert _distance(result["params"], results[0]["params"]) == 0.0, rank
    diff = _distance(results[0]["params"], reference)
    print(f"stage {stage}: after zero_grad, one step is {diff:.3e} from DDP's")
    assert diff <= TOLERANCE
