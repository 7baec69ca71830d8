"""Muon by whole matrices (issue #47): Muon's usual recipe in one ZeroOptimizer.

The hidden 2-D weights of a small GPT (three sizes, six matrices) in a
``torch.optim.Muon`` group, everything else (embeddings, the tied head, the
position table, biases, norms) in AdamW, at stages 1-3 on 1, 2 and 3 Gloo
ranks, against single-process ``torch.optim.Muon`` + ``torch.optim.AdamW`` on
the same global batch, with DDP + the same two optimizers as the yardstick.
Each matrix is owned whole by one rank ([Note: whole parameters] in
partition_layout.h); the wire bytes are measured against AdamW's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard import _C

from dist_harness import run_ranks, unwrap
from tiny_models import (
    Optimizers,
    assert_ranks_match_reference,
    gathered_snapshot,
    make_gpt,
    max_abs_diff,
    snapshot,
    train,
)


class PythonMuon(torch.optim.Muon):
    """torch's Muon under another name: zeroshard runs it as a torch.optim class
    on whole parameters (torch.optim.Muon itself runs the C++ MuonRule)."""


TOLERANCE = 1e-6
STEPS = 5
RELEASED = {"stage3_param_persistence_threshold": 0}
MUON = {"lr": 2e-2, "momentum": 0.95, "nesterov": True, "adjust_lr_fn": "match_rms_adamw"}
ADAMW_LR = 1e-2


def _hidden(model: nn.Module) -> list[nn.Parameter]:
    """The recipe's Muon parameters: the blocks' 2-D weights, norms excluded."""
    return [
        p
        for name, p in model.named_parameters()
        if name.startswith("blocks.") and p.dim() == 2 and ".ln." not in name
    ]


def _rest(model: nn.Module) -> list[nn.Parameter]:
    hidden = {id(p) for p in _hidden(model)}
    return [p for p in model.parameters() if id(p) not in hidden]


def _both(model: nn.Module) -> Optimizers:
    """torch.optim's Muon on the hidden matrices and AdamW on the rest."""
    return Optimizers(
        torch.optim.Muon(_hidden(model), **MUON), torch.optim.AdamW(_rest(model), lr=ADAMW_LR)
    )


def _zero(
    model: nn.Module, stage: int, rule: Any = torch.optim.Muon, offload: str = "none"
) -> zeroshard.ZeroOptimizer:
    # module= names the parameters in checkpoints at every stage.
    module = {"module": model, **(RELEASED if stage == 3 else {})}
    hidden = {"params": _hidden(model), "optimizer": rule, **(MUON if rule is not None else {})}
    if rule is None:  # the same groups, both AdamW: the byte yardstick
        hidden = {"params": _hidden(model)}
    return zeroshard.ZeroOptimizer(
        [hidden, {"params": _rest(model)}],
        "adamw",
        stage=stage,
        lr=ADAMW_LR,
        offload_optimizer=offload,
        **module,
    )


def _train(rank: int, world_size: int, stage: int, rule: Any) -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = _zero(model, stage, rule)
    optimizer.reset_comm_stats()
    train(model, optimizer, STEPS, rank, world_size)
    muon_stats = dict(optimizer.comm_stats())
    # Which matrices this rank owns whole: every element of each, or none.
    owned = []
    for p in _hidden(model):
        start, end = optimizer.state_range(p)
        assert (start, end) in ((0, 0), (0, p.numel())), (start, end, p.shape)
        owned.append(end > 0)
    adamw_model = make_gpt(seed=0)
    adamw = _zero(adamw_model, stage, rule=None)
    adamw.reset_comm_stats()
    train(adamw_model, adamw, STEPS, rank, world_size)
    out: dict[str, Any] = {
        "params": gathered_snapshot(model, optimizer),
        "owned": owned,
        "shapes": [tuple(p.shape) for p in _hidden(model)],
        "muon": muon_stats,
        "adamw": dict(adamw.comm_stats()),
    }
    if world_size > 1:
        ddp_model = make_gpt(seed=0)
        ddp = nn.parallel.DistributedDataParallel(ddp_model)
        train(ddp, _both(ddp_model), STEPS, rank, world_size)
        out["ddp"] = snapshot(ddp_model)
    return out


def _single_process() -> dict[str, torch.Tensor]:
    model = make_gpt(seed=0)
    train(model, _both(model), STEPS, 0, 1)
    return snapshot(model)


@pytest.mark.parametrize("rule", [torch.optim.Muon, PythonMuon], ids=["cpp", "python"])
@pytest.mark.parametrize(
    "world_size,stage", [(1, 1), (1, 3), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (3, 3)]
)
def test_muon_and_adamw_train_as_single_process_torch_optim(
    world_size: int, stage: int, rule: Any
) -> None:
    results = unwrap(run_ranks(world_size, _train, stage, rule))
    expected = _single_process()
    label = f"Muon ({rule.__name__}) + AdamW W={world_size} stage {stage}"
    # One rank: no reduction, the same gradients, yet 3.0e-8 from single-process
    # at stages 1 and 3 (measured 2026-12-07; not the same bits, as this
    # comment said before: an ulp of the update somewhere, not traced). More:
    # Muon orthogonalises in bf16, where the ulps by which a mean of the ranks'
    # means differs from the global mean can round differently; DDP on the same
    # ranks is the yardstick (it measures how far that noise carries).
    tolerance = TOLERANCE
    if world_size > 1:
        ddp_diff = max(max_abs_diff(r["ddp"], expected) for r in results)
        print(f"{label}: DDP {ddp_diff:.3e} from single-process")
        tolerance = max(TOLERANCE, ddp_diff)
    assert_ranks_match_reference([r["params"] for r in results], expected, tolerance, label)
    # Every matrix has exactly one owner, and with at least as many matrices as
    # ranks every rank owns one.
    owners = [sum(r["owned"][i] for r in results) for i in range(len(results[0]["owned"]))]
    assert owners == [1] * len(owners), owners
    assert all(any(r["owned"]) for r in results)
    # The owners are balanced by Newton-Schulz's work (m * n * min(m, n)) over
    # all buckets: no rank owns more than one matrix's work beyond another.
    # Before, the largest slice of every bucket went to rank 0: at stage 3
    # (each block one bucket of 96, 96 and 64 elements) rank 0 of two owned
    # four of the six matrices.
    costs = [m * n * min(m, n) for m, n in results[0]["shapes"]]
    work = [sum(c for c, own in zip(costs, r["owned"], strict=True) if own) for r in results]
    print(f"{label}: Newton-Schulz work per rank {work}")
    assert max(work) - min(work) <= max(costs), work
    # Bytes on the wire: the same reduce-scatter and all-gather as AdamW's, of
    # owner-aligned buckets whose slices are evened by padding; no all-reduce
    # of whole gradients (DeepSpeed's ZeRO-3 Muon all-reduces them: twice the
    # gradient bytes). Where the matrices balance (the six of 96, 96, 96, 96,
    # 64, 64 elements on two ranks, all in one bucket at stages 1-2) nothing is
    # padded; what remains is the agreement each step of a rule's optimizer
    # makes on failures (a rule may fail on one rank only): measured 1.005 of
    # AdamW's bytes on this tiny model, a fixed few bytes a step on a real one.
    # Where the matrices cannot balance, the padding shows: measured 1.083 on
    # three ranks at stages 1-2 (a rank holds two 96s), 1.174 on two ranks at
    # stage 3 (each block is one bucket of 96, 96 and 64) and 1.073 on three.
    # An all-reduce of the Muon gradients would be above 1.3.
    muon, adamw = results[0]["muon"], results[0]["adamw"]
    ratio = muon["wire_bytes"] / max(adamw["wire_bytes"], 1.0)
    print(f"{label}: wire bytes {ratio:.3f} of AdamW's with the same groups")
    if world_size == 2 and stage in (1, 2):
        assert ratio <= 1.01, ratio
    elif world_size > 1:
        assert ratio <= 1.2, ratio


# ---- the C++ Muon is torch.optim.Muon ------------------------------------------------


@pytest.mark.parametrize("shape", [(7, 5), (3, 7), (6, 6)])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False, "weight_decay": 0.0},
        {"adjust_lr_fn": "match_rms_adamw", "lr": 2e-2},
        {"adjust_lr_fn": "original", "momentum": 0.9, "ns_steps": 3},
    ],
)
def test_the_cpp_muon_rule_is_torch_optim_muon_bit_for_bit(
    shape: tuple[int, int], options: dict[str, Any]
) -> None:
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(shape, generator=generator)
    reference = start.clone()
    torch_muon = torch.optim.Muon([reference], **options)
    hyperparameters = {**json.loads(_C.MuonRule.defaults()), **options}
    ours = start.clone()
    momentum = torch.zeros(shape)
    rule = _C.MuonRule()
    for step in range(1, 5):
        grad = torch.randn(shape, generator=generator)
        reference.grad = grad.clone()
        torch_muon.step()
        _C.rule_update(rule, json.dumps(hyperparameters), ours, grad, [momentum], step)
        assert torch.equal(ours, reference), (step, (ours - reference).abs().max())
        assert torch.equal(momentum, torch_muon.state[reference]["momentum_buffer"])


# ---- checkpoints: the owner map changes with the world size and the stage -------------


def _momenta(model: nn.Module, optimizer: Any) -> dict[int, torch.Tensor]:
    """Muon's momentum of each hidden matrix this rank owns, by position."""
    out = {}
    for i, p in enumerate(_hidden(model)):
        state = optimizer.state[p]
        if "momentum_buffer" in state and state["momentum_buffer"].numel() > 0:
            out[i] = state["momentum_buffer"].clone()
    return out


def _save(rank: int, world_size: int, path: str, offload: str = "none") -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = _zero(model, stage=3, offload=offload)
    train(model, optimizer, 3, rank, world_size)
    optimizer.save_checkpoint(path)
    saved = _momenta(model, optimizer)
    train(model, optimizer, 2, rank, world_size, first_step=3)
    return {"momenta": saved, "straight": gathered_snapshot(model, optimizer)}


def _resume(
    rank: int, world_size: int, path: str, stage: int, offload: str = "none"
) -> dict[str, Any]:
    model = make_gpt(seed=9)  # other values: the load restores them
    optimizer = _zero(model, stage, offload=offload)
    optimizer.load_checkpoint(path)
    momenta = _momenta(model, optimizer)
    train(model, optimizer, 2, rank, world_size, first_step=3)
    return {"momenta": momenta, "params": gathered_snapshot(model, optimizer)}


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_checkpoint_saved_at_two_ranks_stage_3_resumes_at_any_world_size(
    tmp_path, offload: str
) -> None:
    # Offloaded ("cpu"): each owner's matrices stepped on the host ([Note: a
    # rule on the host]); the checkpoint resumes on the device all the same.
    path = str(tmp_path / "muon")
    saved = unwrap(run_ranks(2, _save, path, offload))
    by_matrix: dict[int, torch.Tensor] = {}
    for result in saved:
        by_matrix.update(result["momenta"])
    assert sorted(by_matrix) == list(range(6)), sorted(by_matrix)
    # The same world size, stage and offload: the straight run's bits.
    same = unwrap(run_ranks(2, _resume, path, 3, offload))
    for result in same:
        assert max_abs_diff(result["params"], saved[0]["straight"]) == 0.0
    # Three ranks at stage 1 on the device: other owners, the same momenta.
    resumed = unwrap(run_ranks(3, _resume, path, 1))
    seen = set()
    for result in resumed:
        for i, momentum in result["momenta"].items():
            assert torch.equal(momentum, by_matrix[i]), i
            seen.add(i)
    assert seen == set(range(6))
    for result in resumed[1:]:
        assert max_abs_diff(result["params"], resumed[0]["params"]) == 0.0


def _refused(rank: int, world_size: int) -> str:
    model = make_gpt(seed=0)
    try:
        zeroshard.ZeroOptimizer(
            [{"params": list(model.parameters()), "optimizer": torch.optim.Muon}], "adamw"
        )
    except ValueError as error:
        dist.barrier()
        return str(error)
    return "accepted"


def test_a_vector_in_a_muon_group_is_refused_on_every_rank_naming_it() -> None:
    for message in unwrap(run_ranks(2, _refused)):
        assert "torch.optim.Muon cannot update parameter" in message, message
        assert "Muon only supports 2D parameters" in message, message


# ---- with CPU offload: each owner's matrices step on the host -------------------------


def _train_offloaded(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = _zero(model, stage, offload="cpu")
    train(model, optimizer, STEPS, rank, world_size)
    owned = [optimizer.state_range(p) == (0, p.numel()) for p in _hidden(model)]
    host = optimizer.host_model_state_bytes()
    return {"params": gathered_snapshot(model, optimizer), "owned": owned, "host_bytes": host}


@pytest.mark.parametrize("world_size,stage", [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_muon_and_adamw_with_cpu_offload_train_as_single_process(
    world_size: int, stage: int
) -> None:
    # [Note: a rule on the host]: the Muon group's master and momentum, and
    # AdamW's, live in host memory; each owner orthogonalises its matrices
    # there. Within 1e-6 of single-process torch.optim (the device-resident
    # runs measure 6e-8 at two and three ranks).
    results = unwrap(run_ranks(world_size, _train_offloaded, stage))
    label = f"Muon + AdamW offloaded W={world_size} stage {stage}"
    assert_ranks_match_reference([r["params"] for r in results], _single_process(), 1e-6, label)
    owners = [sum(r["owned"][i] for r in results) for i in range(len(results[0]["owned"]))]
    assert owners == [1] * len(owners), owners
    assert all(r["host_bytes"] > 0 for r in results), [r["host_bytes"] for r in results]


# ---- state_dict(): per-rank files that torch.load(weights_only=True) reads ------------


def _state_dict_round_trip(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = _zero(model, stage=2)
    train(model, optimizer, 3, rank, world_size)
    path = f"{directory}/rank{rank}.pt"
    torch.save(optimizer.state_dict(), path)
    train(model, optimizer, 2, rank, world_size, first_step=3)
    straight = gathered_snapshot(model, optimizer)
    resumed_model = make_gpt(seed=0)
    resumed = _zero(resumed_model, stage=2)
    train(resumed_model, resumed, 3, rank, world_size)  # the same weights; the state is loaded
    # torch.load's default since torch 2.6: no class objects, only data.
    saved = torch.load(path, weights_only=True)
    resumed.load_state_dict(saved)
    train(resumed_model, resumed, 2, rank, world_size, first_step=3)
    # Groups that run other optimizers than the saved ones are refused.
    swapped = zeroshard.ZeroOptimizer(
        [{"params": _hidden(model), "optimizer": torch.optim.RAdam}, {"params": _rest(model)}],
        "adamw",
        stage=2,
        lr=ADAMW_LR,
    )
    try:
        swapped.load_state_dict(saved)
        mismatch = "accepted"
    except ValueError as error:
        mismatch = str(error)
    return {
        "groups": [g.get("optimizer") for g in saved["param_groups"]],
        "straight": straight,
        "resumed": gathered_snapshot(resumed_model, resumed),
        "mismatch": mismatch,
    }


def test_a_state_dict_saves_class_names_and_loads_with_weights_only(tmp_path) -> None:
    for result in unwrap(run_ranks(2, _state_dict_round_trip, str(tmp_path))):
        assert result["groups"] == ["torch.optim.Muon", None], result["groups"]
        assert max_abs_diff(result["resumed"], result["straight"]) == 0.0
        expected = "group 0 of the state dict runs torch.optim.Muon, this optimizer's runs "
        assert expected + "torch.optim.RAdam" in result["mismatch"], result["mismatch"]


# ---- checkpoints know each parameter's rule -------------------------------------------


def _load_into_other_groups(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = _zero(model, stage=2)
    train(model, optimizer, 2, rank, world_size)
    optimizer.save_checkpoint(path)
    momenta = _momenta(model, optimizer)
    # The same rules, the groups in the other order: loads.
    reordered_model = make_gpt(seed=4)
    reordered = zeroshard.ZeroOptimizer(
        [
            {"params": _rest(reordered_model)},
            {"params": _hidden(reordered_model), "optimizer": torch.optim.Muon, **MUON},
        ],
        "adamw",
        stage=2,
        lr=ADAMW_LR,
        module=reordered_model,
    )
    reordered.load_checkpoint(path)
    # The hidden matrices with AdamW: their saved state is Muon's momentum.
    adamw_model = make_gpt(seed=4)
    adamw = zeroshard.ZeroOptimizer(
        adamw_model.parameters(), "adamw", stage=2, lr=ADAMW_LR, module=adamw_model
    )
    try:
        adamw.load_checkpoint(path)
        error = "accepted"
    except ValueError as e:
        error = str(e)
    return {"momenta": momenta, "reordered": _momenta(reordered_model, reordered), "error": error}


def test_a_checkpoint_refuses_a_parameter_whose_rule_changed(tmp_path) -> None:
    for result in unwrap(run_ranks(2, _load_into_other_groups, str(tmp_path / "muon"))):
        assert result["reordered"].keys() == result["momenta"].keys()
        for i, momentum in result["momenta"].items():
            assert torch.equal(result["reordered"][i], momentum), i
        error = result["error"]
        assert "holds the state torch.optim.Muon keeps for parameter 'blocks." in error, error
        assert "this optimizer updates with adamw" in error.lower(), error
