"""Mixture of experts with expert parallelism on 4 CPU ranks, ZeRO stages 1-3.

Four experts, top-1 routing that depends on the data. With expert parallel
size 2, each rank holds 2 experts and tokens travel to their expert's rank
and back by all-to-all (with autograd); expert parameters are sharded over
their expert-data-parallel group (the ranks holding the same experts), dense
ones over all 4 ranks. Some experts get no token on some ranks (checked).
The result equals single-process ``torch.optim`` on the whole model and the
global batch, with the global-norm clipping of both optimizers together. At
stage 3 both optimizers hook the model, and the experts' unit is the block
that routes (here the whole ``Net``), gathered on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap

WORLD, EXPERTS = 4, 4
D, H, C = 6, 10, 3
TOKENS = 24  # global batch: 6 per rank
STEPS = 6
LR = 1e-2
CLIP = 0.5
TOLERANCE = 1e-6


def _expert(e: int) -> nn.Module:
    torch.manual_seed(100 + e)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))


class Net(nn.Module):
    """A dense input layer, a top-1 MoE layer over `local` experts, a dense head."""

    def __init__(self, local: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.gate = nn.Linear(D, EXPERTS)
        self.out = nn.Linear(D, C)
        self.expert_ids = local
        self.experts = nn.ModuleList(_expert(e) for e in local)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(h), dim=-1)
        choice = probs.argmax(dim=-1)
        return choice, probs.gather(1, choice[:, None])

    def run_experts(self, h: torch.Tensor, choice: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Each local expert on its tokens; an expert with no token is not called."""
        out = torch.zeros_like(h)
        used = []
        for expert_id, expert in zip(self.expert_ids, self.experts, strict=True):
            mask = choice == expert_id
            if mask.any():
                out = out.index_put((mask.nonzero()[:, 0],), expert(h[mask]))
                used.append(expert_id)
        return out, used

    def forward(self, x: torch.Tensor, ep_group: Any = None) -> tuple[torch.Tensor, list[int]]:
        h = torch.tanh(self.inp(x))
        choice, weight = self.route(h)
        if ep_group is None:
            y, used = self.run_experts(h, choice)
        else:
            y, used = self._dispatch(h, choice, ep_group)
        return self.out(h + weight * y), used

    def _dispatch(
        self, h: torch.Tensor, choice: torch.Tensor, group: Any
    ) -> tuple[torch.Tensor, list[int]]:
        ep = dist.get_world_size(group)
        per_rank = EXPERTS // ep
        destination = choice // per_rank
        order = torch.argsort(destination, stable=True)
        send = torch.bincount(destination, minlength=ep)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=group)
        send_sizes, receive_sizes = send.tolist(), receive.tolist()
        tokens = h[order]
        arrived = dist_fn.all_to_all_single(
            h.new_empty(sum(receive_sizes), D), tokens, receive_sizes, send_sizes, group=group
        )
        arrived_choice = choice.new_empty(sum(receive_sizes))
        dist.all_to_all_single(
            arrived_choice, choice[order], receive_sizes, send_sizes, group=group
        )
        computed, used = self.run_experts(arrived, arrived_choice)
        back = dist_fn.all_to_all_single(
            h.new_empty(h.shape[0], D), computed, send_sizes, receive_sizes, group=group
        )
        return torch.empty_like(back).index_copy(0, order, back), used


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(TOKENS, D, generator=g) * 2, torch.randn(TOKENS, C, generator=g)


def reference(skip: int | None = None) -> dict[str, torch.Tensor]:
    model = Net(list(range(EXPERTS)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        if step == skip:
            continue
        x, y = batch(step)
        optimizer.zero_grad()
        out, _ = model(x)
        (out - y).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return _named(model)


def _named(model: Net) -> dict[str, torch.Tensor]:
    """Dense parameters by name, experts by their global id."""
    out = {
        n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("experts")
    }
    for expert_id, expert in zip(model.expert_ids, model.experts, strict=True):
        for n, p in expert.named_parameters():
            out[f"expert{expert_id}.{n}"] = p.detach().clone()
    return out


def _expert_names(model: Net) -> dict[str, torch.Tensor]:
    """Each expert's parameters under its global name, whatever rank holds it."""
    return {
        f"expert{e}.{n}": p
        for e, expert in zip(model.expert_ids, model.experts, strict=True)
        for n, p in expert.named_parameters()
    }


def _stage2_experts(params: Any, mesh: Any, world_size: int, **extra: Any) -> Any:
    """The expert optimizer of the checkpoint tests: stage 2 over the edp group."""
    return zeroshard.ZeroOptimizer(
        params,
        stage=2,
        device_mesh=mesh["edp"],
        expert_parallel_group=mesh["ep"].get_group(),
        gradient_divide_factor=world_size,
        **extra,
    )


def _train(
    rank: int,
    world_size: int,
    stage: int,
    ep: int,
    inf_at: int | None = None,
    checkpoint: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """STEPS steps; with ``checkpoint``, a save of both optimizers after 3
    steps, or (``resume``) a load and the last STEPS - 3."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("edp", "ep"))
    ep_rank = mesh["ep"].get_local_rank()
    per_rank = EXPERTS // ep
    model = Net(list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank)))
    expert_params = list(model.experts.parameters())
    expert_ids = {id(p) for p in expert_params}
    # Stage 3: both optimizers hook the model; the dense one leaves the
    # experts to the other, whose one unit is the MoE block (here the whole
    # Net), so entering it gathers every local expert, routed to or not.
    dense_only = {"module": model, "ignored_params": expert_params} if stage == 3 else {}
    experts_only = {"module": model, "unit_classes": (Net,)} if stage == 3 else {}
    dense = zeroshard.ZeroOptimizer(
        [p for p in model.parameters() if id(p) not in expert_ids],
        "adamw",
        stage=stage,
        lr=LR,
        stage3_param_persistence_threshold=0,
        skip_nonfinite_steps=inf_at is not None,
        **dense_only,
    )
    experts = zeroshard.ZeroOptimizer(
        expert_params,
        "adamw",
        stage=stage,
        lr=LR,
        device_mesh=mesh["edp"],
        expert_parallel_group=mesh["ep"].get_group(),
        gradient_divide_factor=WORLD,
        stage3_param_persistence_threshold=0,
        skip_nonfinite_steps=inf_at is not None,
        # Which expert a tensor is, whatever rank holds it: checkpoints load
        # at any expert-parallel degree.
        param_names=_expert_names(model),
        **experts_only,
    )
    assert experts._impl.model_parallel() == "expert"
    ep_group = mesh["ep"].get_group() if ep > 1 else None
    per = TOKENS // WORLD
    used_per_step, skipped = [], []
    first = 0
    if checkpoint is not None and resume:
        dense.load_checkpoint(f"{checkpoint}/dense")
        experts.load_checkpoint(f"{checkpoint}/experts")
        first = 3
    for step in range(first, STEPS):
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        dense.zero_grad()
        experts.zero_grad()
        out, used = model(x, ep_group)
        used_per_step.append(used)
        (out - y).pow(2).mean().backward()
        if step == inf_at and rank == 0:  # one expert, one rank
            next(p for p in expert_params if p.grad is not None).grad.fill_(float("inf"))
        zeroshard.clip_grad_norm_([dense, experts], CLIP)
        dense.step()
        experts.step()
        skipped.append((dense.last_step_skipped(), experts.last_step_skipped()))
        if checkpoint is not None and not resume and step + 1 == 3:
            dense.save_checkpoint(f"{checkpoint}/dense")
            experts.save_checkpoint(f"{checkpoint}/experts")
    with dense.gathered_parameters(), experts.gathered_parameters():
        params = _named(model)
    units = (dense.units, experts.units) if stage == 3 else None
    return {
        "params": params,
        "used": used_per_step,
        "local": model.expert_ids,
        "units": units,
        "skipped": skipped,
    }


@pytest.mark.parametrize(("stage", "ep"), [(1, 2), (2, 2), (2, 1), (3, 2), (3, 1)])
def test_moe_with_expert_parallelism_matches_torch_optim(stage: int, ep: int) -> None:
    results = unwrap(run_ranks(WORLD, _train, stage, ep))
    expected = reference()
    idle = 0
    for rank, r in enumerate(results):
        idle += sum(len(r["local"]) - len(used) for used in r["used"])
        for name, value in r["params"].items():
            diff = (value - expected[name]).abs().max().item()
            assert diff <= TOLERANCE, (rank, name, diff)
        worst = max((v - expected[n]).abs().max().item() for n, v in r["params"].items())
        print(f"stage {stage} ep {ep} rank {rank}: experts {r['local']}, max abs diff {worst:.3e}")
    # The routing left some local experts without a token on some steps.
    assert idle > 0
    if stage == 3:
        assert results[0]["units"] == (["inp", "gate", "out"], ["<root>"]), results[0]["units"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_non_finite_expert_gradient_skips_both_optimizers_together(stage: int) -> None:
    # An inf in one expert's gradient on rank 0 at step 2: the joint norm is
    # inf on every rank, so the dense optimizer skips with the experts (it
    # used to step with its gradients scaled by 0), equal to torch.optim
    # without step 2.
    results = unwrap(run_ranks(WORLD, _train, stage, 2, 2))
    expected = reference(skip=2)
    for rank, r in enumerate(results):
        assert r["skipped"] == [(False, False)] * 2 + [(True, True)] + [(False, False)] * 3, r
        worst = max((v - expected[n]).abs().max().item() for n, v in r["params"].items())
        print(f"stage {stage} rank {rank}: step 2 skipped by both, max abs diff {worst:.3e}")
        assert worst <= TOLERANCE, (rank, worst)


def _stray(rank: int, world_size: int) -> str:
    model = Net([0, 1])
    try:
        zeroshard.ZeroOptimizer(
            [p for n, p in model.named_parameters() if not n.startswith("experts")],
            stage=3,
            module=model,
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_stage3_parameters_held_by_no_optimizer_are_an_error_naming_them() -> None:
    for message in run_ranks(2, _stray):
        assert "8 parameters of module= are not in this optimizer" in message, message
        assert "'experts.0.0.weight'" in message and "ignored_params=" in message, message


def _save_experts(rank: int, world_size: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    model = Net([2 * mesh["ep"].get_local_rank(), 2 * mesh["ep"].get_local_rank() + 1])
    experts = _stage2_experts(model.experts.parameters(), mesh, world_size)
    try:
        experts.save_checkpoint(path)
    except ValueError as error:
        return str(error)
    return "no error"


def test_experts_saved_under_local_names_are_an_error_on_every_rank(tmp_path) -> None:
    # Without param_names both expert-parallel ranks would store their own
    # experts under the same names ("group0.0", ...).
    for message in run_ranks(WORLD, _save_experts, str(tmp_path / "ckpt")):
        assert "a name must stand for one tensor on every rank" in message, message
    assert not (tmp_path / "ckpt").exists()


def _grouped_experts(rank: int, world_size: int, path: str, swap_on_second: bool) -> str:
    """Experts in two groups (weights, biases at another lr): saved, or loaded
    with the groups swapped on expert-parallel rank 1 only."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    ep_rank = mesh["ep"].get_local_rank()
    model = Net([2 * ep_rank, 2 * ep_rank + 1])
    names = _expert_names(model)
    groups = [
        {"params": [p for n, p in names.items() if n.endswith("weight")], "lr": LR},
        {"params": [p for n, p in names.items() if n.endswith("bias")], "lr": LR / 2},
    ]
    if swap_on_second and ep_rank == 1:
        groups.reverse()
    experts = _stage2_experts(groups, mesh, world_size, param_names=names)
    if not swap_on_second:
        experts.save_checkpoint(path)
        return "saved"
    try:
        experts.load_checkpoint(path)
    except ValueError as error:
        return str(error)
    return "no error"


def test_experts_grouped_otherwise_on_some_ranks_are_an_error_on_every_rank(tmp_path) -> None:
    # Rank 0's groups match the saved ones and rank 1's do not: each alone
    # would take the hyper-parameters from a different place (the saved
    # groups' or its own), so the ranks would train with different ones.
    path = str(tmp_path / "ckpt")
    assert run_ranks(WORLD, _grouped_experts, path, False) == ["saved"] * WORLD
    for message in run_ranks(WORLD, _grouped_experts, path, True):
        assert "parameter groups match this optimizer's on 2 of 4 ranks only" in message, message


@pytest.mark.parametrize("stage", [2, 3])
def test_moe_checkpoint_resumes_and_loads_at_another_expert_parallel_degree(
    stage: int, tmp_path
) -> None:
    # Saved at expert parallel 2 after 3 steps; resumed at 2 (bit for bit)
    # and at 1 (every rank all 4 experts), both equal to torch.optim's 6 steps.
    path = str(tmp_path)
    first = unwrap(run_ranks(WORLD, _train, stage, 2, None, path))
    index = zeroshard.checkpoint.read_index(f"{path}/experts")
    names = {p["name"] for p in index["params"]}
    assert {n.split(".")[0] for n in names} == {f"expert{e}" for e in range(EXPERTS)}, names
    same = unwrap(run_ranks(WORLD, _train, stage, 2, None, path, True))
    other = unwrap(run_ranks(WORLD, _train, stage, 1, None, path, True))
    expected = reference()
    for rank in range(WORLD):
        for name, value in same[rank]["params"].items():
            assert torch.equal(value, first[rank]["params"][name]), (rank, name)
        worst = max((v - expected[n]).abs().max().item() for n, v in other[rank]["params"].items())
        print(f"stage {stage} rank {rank}: resumed at expert parallel 1, max abs diff {worst:.3e}")
        assert worst <= TOLERANCE, (rank, worst)


def _damaged_expert_swap(rank: int, world_size: int, path: str) -> str:
    """Experts' optimizer state on NVMe; rank 0's swap file truncated after a step."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    ep_rank = mesh["ep"].get_local_rank()
    model = Net([2 * ep_rank, 2 * ep_rank + 1])
    experts = _stage2_experts(
        model.experts.parameters(),
        mesh,
        world_size,
        offload_optimizer={"device": "nvme", "nvme_path": path},
        sub_group_size=64,
    )

    def step(number: int) -> None:
        x, y = batch(number)
        per = TOKENS // WORLD
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        experts.zero_grad()
        out, _ = model(x, mesh["ep"].get_group())
        (out - y).pow(2).mean().backward()
        experts.step()

    step(0)
    if rank == 0:
        os.truncate(os.path.join(experts.nvme_stats()["directory"], "optimizer.swap"), 0)
    try:
        step(1)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_failed_nvme_read_on_one_expert_rank_is_an_error_on_every_rank(tmp_path) -> None:
    # Rank 0's expert-data-parallel peer (rank 2) learns of the failure in the
    # shard group's agreement; its expert-parallel peers (ranks 1 and 3) only
    # in the expert-parallel leg, without which they would step on and wait
    # for rank 0 in the next collective until the timeout.
    for rank, message in enumerate(run_ranks(WORLD, _damaged_expert_swap, str(tmp_path))):
        print(f"rank {rank}: {message}")
        assert "could not update the optimizer state or parameters on NVMe" in message, message
        assert "optimizer.swap" in message and "met the end of the file" in message, message
