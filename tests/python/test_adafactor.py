"""Adafactor by whole parameters (issue #47): states of shapes of their own.

``torch.optim.Adafactor`` keeps, per matrix, a row statistic ``[m, 1]`` and a
column statistic ``[1, n]``, and per vector a ``variance`` of its shape; its
step reads the whole parameter (its norm). zeroshard gives each parameter one
owning rank ([Note: whole parameters] in partition_layout.h), which holds
those states in their shapes ([Note: parameter states] in update_rule.h):
``m + n`` floats per matrix, not ``m * n``. Every parameter of a small GPT
(embeddings, the tied head, biases and norms included) in Adafactor, at
stages 1-3 on 2 and 3 Gloo ranks, on the device and with CPU offload, against
single-process ``torch.optim.Adafactor`` on the same global batch, with DDP +
the same optimizer as the yardstick; checkpoints that resume at another world
size and stage; the memory the states take and what the estimator says.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import (
    assert_ranks_match_reference,
    gathered_snapshot,
    make_gpt,
    max_abs_diff,
    snapshot,
    train,
)

TOLERANCE = 1e-6
STEPS = 5
LR = 1e-2
RELEASED = {"stage3_param_persistence_threshold": 0}


def _zero(model: nn.Module, stage: int, offload: str = "none") -> zeroshard.ZeroOptimizer:
    module = {"module": model, **(RELEASED if stage == 3 else {})}
    return zeroshard.ZeroOptimizer(
        model.parameters(),
        torch.optim.Adafactor,
        lr=LR,
        stage=stage,
        offload_optimizer=offload,
        **module,
    )


def _own_states(model: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The Adafactor states this rank holds, by parameter name: its owned
    parameters', in their shapes."""
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        held = {k: v.clone() for k, v in state.items() if k != "step" and v.numel() > 0}
        if held:
            out[name] = held
    return out


def _train(rank: int, world_size: int, stage: int, offload: str) -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = _zero(model, stage, offload)
    train(model, optimizer, STEPS, rank, world_size)
    out: dict[str, Any] = {
        "params": gathered_snapshot(model, optimizer),
        "states": _own_states(model, optimizer),
        "state_bytes": optimizer.optimizer_state_bytes(),
    }
    if world_size > 1:
        ddp_model = make_gpt(seed=0)
        ddp = nn.parallel.DistributedDataParallel(ddp_model)
        train(ddp, torch.optim.Adafactor(ddp_model.parameters(), lr=LR), STEPS, rank, world_size)
        out["ddp"] = snapshot(ddp_model)
    return out


def _single_process() -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    model = make_gpt(seed=0)
    optimizer = torch.optim.Adafactor(model.parameters(), lr=LR)
    train(model, optimizer, STEPS, 0, 1)
    states = {
        name: {k: v for k, v in optimizer.state[p].items() if k != "step"}
        for name, p in model.named_parameters()
    }
    return snapshot(model), states


@pytest.mark.parametrize(
    "world_size,stage,offload",
    [
        (2, 1, "none"),
        (2, 2, "none"),
        (2, 3, "none"),
        (3, 1, "none"),
        (3, 2, "none"),
        (3, 3, "none"),
        (2, 2, "cpu"),
        (3, 3, "cpu"),
    ],
)
def test_adafactor_trains_as_single_process_torch_optim(
    world_size: int, stage: int, offload: str
) -> None:
    results = unwrap(run_ranks(world_size, _train, stage, offload))
    expected, expected_states = _single_process()
    label = f"Adafactor W={world_size} stage {stage} offload {offload}"
    # Adafactor divides by an RMS of the update and scales by the parameter's
    # RMS: reduction-order noise in the gradients carries into every element.
    # DDP on the same ranks is the yardstick.
    ddp_diff = max(max_abs_diff(r["ddp"], expected) for r in results)
    print(f"{label}: DDP {ddp_diff:.3e} from single-process")
    tolerance = max(TOLERANCE, ddp_diff)
    assert_ranks_match_reference([r["params"] for r in results], expected, tolerance, label)
    # Each parameter's states are held by exactly one rank, in torch's shapes
    # (row_var [m, 1] and col_var [1, n] of a matrix, a vector's variance),
    # with torch's values.
    holders: dict[str, int] = {}
    for result in results:
        for name, states in result["states"].items():
            holders[name] = holders.get(name, 0) + 1
            assert set(states) == set(expected_states[name]), (name, set(states))
            for key, value in states.items():
                reference = expected_states[name][key]
                assert value.shape == reference.shape, (name, key, value.shape)
                scale = max(reference.abs().max().item(), 1e-12)
                assert (value - reference).abs().max().item() <= 1e-4 * scale, (name, key)
    assert holders == {name: 1 for name in expected_states}, holders
    # Memory: m + n floats per matrix, not m * n, each held once. On the
    # device, fp32 parameters are their own master ([Note: fp32 master]), so
    # the factored statistics are all the optimizer state there is.
    factored = sum(v.numel() for states in expected_states.values() for v in states.values())
    numel = sum(p.numel() for p in expected.values())
    held = sum(r["state_bytes"] for r in results)
    print(f"{label}: optimizer state {held} bytes on all ranks, {numel * 4} of parameters")
    assert factored < numel / 2, (factored, numel)
    if offload == "none":
        assert held == factored * 4, (held, factored)
    else:  # and an fp32 master of every element on the host, with its staging
        assert held >= (factored + numel) * 4, (held, factored, numel)


def _partly_offloaded(rank: int, world_size: int) -> dict[str, Any]:
    model = make_gpt(seed=0)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() != 2]
    optimizer = zeroshard.ZeroOptimizer(
        [{"params": matrices}, {"params": vectors}],
        torch.optim.Adafactor,
        lr=LR,
        stage=2,
        offload_optimizer={"device": "cpu", "ratio": 0.5},
    )
    train(model, optimizer, STEPS, rank, world_size)
    return {
        "params": gathered_snapshot(model, optimizer),
        "device": optimizer.device_model_state_bytes(),
        "host": optimizer.host_model_state_bytes(),
    }


def test_with_part_of_the_groups_offloaded_it_trains_as_single_process() -> None:
    """offload ratio 0.5 over two groups: a rule's group is one sub-group, so
    one stays on the device tier and one goes to the host, each with its
    factored states (on a GPU the device tier's must sit beside its master on
    the GPU: a CPU run cannot see where, only that both tiers step right)."""
    results = unwrap(run_ranks(2, _partly_offloaded))
    for rank, result in enumerate(results):
        print(f"rank {rank}: device {result['device']} bytes, host {result['host']} bytes")
        assert result["device"] > 0 and result["host"] > 0, result
    expected, _ = _single_process()
    assert_ranks_match_reference(
        [r["params"] for r in results], expected, TOLERANCE, "Adafactor, offload ratio 0.5"
    )


# ---- checkpoints: other owners at another world size and stage ------------------------


def _save(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = _zero(model, stage=3)
    train(model, optimizer, 3, rank, world_size)
    optimizer.save_checkpoint(path)
    saved = _own_states(model, optimizer)
    train(model, optimizer, 2, rank, world_size, first_step=3)
    return {"states": saved, "straight": gathered_snapshot(model, optimizer)}


def _resume(rank: int, world_size: int, path: str, stage: int) -> dict[str, Any]:
    model = make_gpt(seed=9)  # other values: the load restores them
    optimizer = _zero(model, stage)
    optimizer.load_checkpoint(path)
    states = _own_states(model, optimizer)
    train(model, optimizer, 2, rank, world_size, first_step=3)
    return {"states": states, "params": gathered_snapshot(model, optimizer)}


def test_a_checkpoint_saved_at_two_ranks_stage_3_resumes_at_three_ranks_stage_1(
    tmp_path,
) -> None:
    path = str(tmp_path / "adafactor")
    saved = unwrap(run_ranks(2, _save, path))
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for result in saved:
        by_name.update(result["states"])
    # The same world size and stage: the straight run's bits.
    for result in unwrap(run_ranks(2, _resume, path, 3)):
        assert max_abs_diff(result["params"], saved[0]["straight"]) == 0.0
    # Three ranks at stage 1: other owners, the same states, and the run goes
    # on as the straight one (another reduction order: DDP-sized noise).
    resumed = unwrap(run_ranks(3, _resume, path, 1))
    seen = set()
    for result in resumed:
        for name, states in result["states"].items():
            for key, value in states.items():
                assert torch.equal(value, by_name[name][key]), (name, key)
            seen.add(name)
    assert seen == set(by_name)
    diff = max_abs_diff(resumed[0]["params"], saved[0]["straight"])
    print(f"resumed at three ranks, stage 1: {diff:.3e} from the straight run")
    assert diff <= 1e-5, diff
    for result in resumed[1:]:
        assert max_abs_diff(result["params"], resumed[0]["params"]) == 0.0
    # The consolidated reader gives the states in their shapes.
    states = zeroshard.checkpoint.read_states(path)
    for name, held in by_name.items():
        for key, value in held.items():
            assert torch.equal(states[key][name], value), (name, key)


def test_the_estimator_counts_factored_states_from_the_model() -> None:
    model = make_gpt(seed=0)
    numel = sum(p.numel() for p in model.parameters())
    adamw = zeroshard.estimate(model=model, world_size=2, stages=(1,), precision="fp32")
    adafactor = zeroshard.estimate(
        model=model, world_size=2, stages=(1,), precision="fp32", optimizer=torch.optim.Adafactor
    )
    kept = 0
    for p in model.parameters():
        if p.dim() >= 2:
            kept += math.prod(p.shape[:-1]) + math.prod(p.shape[:-2]) * p.shape[-1]
        else:
            kept += p.numel()
    # AdamW keeps two states per element; Adafactor what the shapes give.
    saved = adamw[0]["optimizer_bytes"] - adafactor[0]["optimizer_bytes"]
    expected = (2 * numel - kept) * 4 / 2
    assert abs(saved - expected) <= 1e-6 * expected, (saved, expected)
    with pytest.raises(ValueError, match="give model="):
        zeroshard.estimate(num_params=numel, optimizer=torch.optim.Adafactor)


def _state_dict_round_trip(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = _zero(model, stage=2)
    train(model, optimizer, 3, rank, world_size)
    path = f"{directory}/rank{rank}.pt"
    torch.save(optimizer.state_dict(), path)
    with optimizer.gathered_parameters():
        weights = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, optimizer, 2, rank, world_size, first_step=3)
    straight = gathered_snapshot(model, optimizer)
    model = make_gpt(seed=9)
    model.load_state_dict(weights)
    optimizer = _zero(model, stage=2)
    optimizer.load_state_dict(torch.load(path, weights_only=True))
    train(model, optimizer, 2, rank, world_size, first_step=3)
    # optimizer.state[p] writes a state of its own shape on its owner.
    written = None
    for p in model.parameters():
        state = optimizer.state[p]
        if "row_var" in state and state["row_var"].numel() > 0:
            state["row_var"] = torch.full_like(state["row_var"], 0.5)
            written = optimizer.state[p]["row_var"]
            break
    return {"diff": max_abs_diff(gathered_snapshot(model, optimizer), straight), "written": written}


def test_a_state_dict_round_trip_continues_exactly(tmp_path) -> None:
    results = unwrap(run_ranks(2, _state_dict_round_trip, str(tmp_path)))
    for result in results:
        assert result["diff"] == 0.0, result["diff"]
    written = [r["written"] for r in results if r["written"] is not None]
    assert written and all(torch.equal(w, torch.full_like(w, 0.5)) for w in written)


# ---- transformers' Adafactor (Trainer's optim="adafactor") ----------------------------


def _train_transformers(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    from transformers.optimization import Adafactor

    model = make_gpt(seed=0)
    module = {"module": model, **(RELEASED if stage == 3 else {})}
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), Adafactor, stage=stage, **module)
    train(model, optimizer, STEPS, rank, world_size)
    ddp_model = make_gpt(seed=0)
    ddp = nn.parallel.DistributedDataParallel(ddp_model)
    train(ddp, Adafactor(ddp_model.parameters()), STEPS, rank, world_size)
    return {
        "params": gathered_snapshot(model, optimizer),
        "states": _own_states(model, optimizer),
        "ddp": snapshot(ddp_model),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_transformers_adafactor_trains_as_single_process(stage: int) -> None:
    """transformers' Adafactor (relative steps, parameter scaling) keeps [m]
    and [n] for a matrix, a Python int step and a recomputed RMS: the owner
    keeps its statistics in those shapes, and it trains as in one process."""
    transformers = pytest.importorskip("transformers")
    adafactor = transformers.optimization.Adafactor
    results = unwrap(run_ranks(2, _train_transformers, stage))
    model = make_gpt(seed=0)
    reference = adafactor(model.parameters())
    train(model, reference, STEPS, 0, 1)
    expected = snapshot(model)
    label = f"transformers Adafactor W=2 stage {stage}"
    ddp_diff = max(max_abs_diff(r["ddp"], expected) for r in results)
    print(f"{label}: DDP {ddp_diff:.3e} from single-process")
    assert_ranks_match_reference(
        [r["params"] for r in results], expected, max(TOLERANCE, ddp_diff), label
    )
    for name, p in model.named_parameters():
        held = [r["states"][name] for r in results if name in r["states"]]
        assert len(held) == 1, (name, len(held))
        for key, value in reference.state[p].items():
            if isinstance(value, torch.Tensor) and key in ("exp_avg_sq_row", "exp_avg_sq_col"):
                assert held[0][key].shape == value.shape, (name, key)
