"""Training loops that go off the happy path: frozen parameters, an exception in
forward or backward that the loop catches, no_sync after a synced backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import SEQ, VOCAB, assert_ranks_match_reference, make_gpt, snapshot

STEPS = 5
BATCH = 12


def batch(step: int, micro: int, rank: int, world_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(40_000 + 100 * step + micro)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    per_rank = BATCH // world_size
    return tokens[rank * per_rank : (rank + 1) * per_rank]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))


def frozen_model() -> nn.Module:
    model = make_gpt(seed=0)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)  # e.g. a frozen backbone layer
    return model


def _frozen(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    model = frozen_model()
    extra = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), "adamw", stage=stage, lr=1e-2, reduce_bucket_size=64, **extra
    )
    optimizer.set_event_log_enabled(True)
    # The second step's events: the first backward launches buckets in layout
    # order, and at stage 3 the first bucket is the root unit's, which holds
    # the embeddings whose gradients come last; from the second backward on,
    # buckets launch in the order the first one saw them complete.
    first_step_events = 0
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, batch(step, 0, rank, world_size)).backward()
        if step == 1:
            log = optimizer.event_log()[first_step_events:]
        optimizer.step()
        if step == 0:
            first_step_events = len(optimizer.event_log())
    with optimizer.gathered_parameters():
        return {"params": snapshot(model), "log": log}


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_do_not_hold_back_the_other_buckets(stage: int) -> None:
    results = unwrap(run_ranks(2, _frozen, stage))
    model = frozen_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, batch(step, 0, 0, 1)).backward()
        optimizer.step()
    assert_ranks_match_reference(
        [r["params"] for r in results], snapshot(model), 1e-6, f"frozen stage {stage}"
    )
    log = results[0]["log"]
    launches = [i for i, e in enumerate(log) if e[0] == "launch" and e[1] == "reduce_scatter"]
    hooks = [i for i, e in enumerate(log) if e[0] == "grad_ready"]
    print(f"stage {stage}: first reduce-scatter at event {launches[0]}, last hook {hooks[-1]}")
    # Buckets launch during backward although a block never reports a gradient.
    assert launches[0] < hooks[-1]


class InjectedError(Exception):
    pass


def _recover(rank: int, world_size: int, stage: int, where: str) -> dict[str, Any]:
    model = make_gpt(seed=0)
    extra = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), "adamw", stage=stage, lr=1e-2, **extra)
    failures = 0
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens = batch(step, 0, rank, world_size)
        try:
            if step == 2 and where == "forward":
                handle = model.blocks[1].mix.register_forward_hook(_raise)
                try:
                    loss_of(model, tokens)
                finally:
                    handle.remove()
            loss = loss_of(model, tokens)
            if step == 2 and where == "backward":
                # Fails halfway through backward, after some gradients arrived.
                model.blocks[0].mix.weight.register_hook(_raise_once())
            loss.backward()
        except InjectedError:
            failures += 1
            continue  # the loop drops this batch, as users do after e.g. an OOM
        optimizer.step()
    gathered = optimizer.gathered_parameter_bytes()
    with optimizer.gathered_parameters():
        return {"params": snapshot(model), "failures": failures, "gathered": gathered}


def _raise(*_: Any) -> None:
    raise InjectedError("injected")


def _raise_once():
    fired = {"done": False}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not fired["done"]:
            fired["done"] = True
            raise InjectedError("injected")
        return grad

    return hook


@pytest.mark.parametrize(("stage", "where"), [(2, "backward"), (3, "forward"), (3, "backward")])
def test_a_caught_exception_in_forward_or_backward_does_not_poison_training(stage, where) -> None:
    results = unwrap(run_ranks(2, _recover, stage, where))
    model = make_gpt(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        if step == 2:
            continue
        optimizer.zero_grad()
        loss_of(model, batch(step, 0, 0, 1)).backward()
        optimizer.step()
    for r in results:
        assert r["failures"] == 1
        if stage == 3:
            assert r["gathered"] == 0  # nothing left gathered between steps
    assert_ranks_match_reference(
        [r["params"] for r in results], snapshot(model), 1e-6, f"recover stage {stage} {where}"
    )


def _synced_then_no_sync(rank: int, world_size: int) -> dict[str, Any]:
    model = make_gpt(seed=0)
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), "sgd", stage=2, lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        (loss_of(model, batch(step, 0, rank, world_size)) / 2).backward()
        with optimizer.no_sync():  # after the synced pass: must still be reduced at step()
            (loss_of(model, batch(step, 1, rank, world_size)) / 2).backward()
        optimizer.step()
    return snapshot(model)


def test_no_sync_after_a_synced_backward_is_reduced_at_step() -> None:
    results = unwrap(run_ranks(2, _synced_then_no_sync))
    model = make_gpt(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(2):
            (loss_of(model, batch(step, micro, 0, 1)) / 2).backward()
        optimizer.step()
    assert_ranks_match_reference(results, snapshot(model), 1e-6, "synced then no_sync")


# ---- A parameter only some ranks use ---------------------------------------------------


def _two_layers() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(3, 3), nn.Linear(3, 3)


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(2, 3, generator=torch.Generator().manual_seed(40 + rank))


def _used_on_rank_0_only(rank: int, world_size: int, stage: int) -> dict[str, torch.Tensor]:
    a, b = _two_layers()
    model = nn.ModuleDict({"a": a, "b": b})
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), "adamw", stage=stage, lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        x = _inputs(rank)
        # b's whole bucket has no gradient on rank 1.
        loss = a(x).pow(2).sum() + (b(x).pow(2).sum() if rank == 0 else 0)
        loss.backward()
        optimizer.step()
    return snapshot(model)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_used_on_some_ranks_only_trains_and_does_not_hang(stage: int) -> None:
    # It hung: the bucket-order broadcast ran only on ranks that had completed
    # a bucket.
    a, b = _two_layers()
    model = nn.ModuleDict({"a": a, "b": b})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        x0, x1 = _inputs(0), _inputs(1)
        ((a(x0).pow(2).sum() + b(x0).pow(2).sum() + a(x1).pow(2).sum()) / 2).backward()
        optimizer.step()
    results = unwrap(run_ranks(2, _used_on_rank_0_only, stage))
    assert_ranks_match_reference(results, snapshot(model), 1e-6, f"stage {stage}")


class _TwoGroups(nn.Module):
    """With 8-element buckets, a and b share group 0's last bucket (buckets
    are cut from a group's last parameter back): one rank's slice holds a, the
    other's the never-used b, so only one rank updates anything there and
    only that rank passes group 0's first bucket during the update. Group 1
    has two buckets of another size."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w0 = nn.Parameter(torch.randn(8, generator=g))
        self.a = nn.Parameter(torch.randn(4, generator=g))
        self.b = nn.Parameter(torch.randn(4, generator=g))  # never used
        self.c1 = nn.Parameter(torch.randn(6, generator=g))
        self.c2 = nn.Parameter(torch.randn(6, generator=g))

    def groups(self) -> list[dict[str, Any]]:
        return [
            {"params": [self.a, self.b, self.w0]},
            {"params": [self.c1, self.c2], "weight_decay": 0.0},
        ]

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return (
            (self.w0 * x[:8]).sum() ** 2
            + (self.a * x[:4]).sum() ** 2
            + (torch.cat([self.c1, self.c2]) * x).sum() ** 2
        )


def _two_groups_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(12, generator=torch.Generator().manual_seed(10 * step + rank))


def _train_two_groups(rank: int, world_size: int, stage: int) -> dict[str, torch.Tensor]:
    model = _TwoGroups()
    optimizer = zeroshard.ZeroOptimizer(
        model.groups(), "adamw", stage=stage, lr=0.05, weight_decay=0.1, reduce_bucket_size=8
    )
    for step in range(4):
        optimizer.zero_grad()
        (model.loss(_two_groups_batch(step, rank)) / world_size).backward()
        optimizer.step()
    return snapshot(model)


@pytest.mark.parametrize("stage", [1, 2])
def test_parameter_gathers_keep_one_order_when_ranks_update_different_buckets(stage: int) -> None:
    # Each bucket's all-gather starts as soon as the update has passed it.
    # Where that happens depends on the rank's slice (one rank has nothing to
    # update in group 0's last bucket): the gathers went out as g0b0, g1b0,
    # g0b1 on one rank and g1b0, g0b0, g0b1 on the other (Gloo: "Received data
    # size doesn't match expected size", then a hang) until each group's were
    # launched before the next group's.
    model = _TwoGroups()
    optimizer = torch.optim.AdamW(model.groups(), lr=0.05, weight_decay=0.1)
    for step in range(4):
        optimizer.zero_grad()
        sum(model.loss(_two_groups_batch(step, r)) / 2 for r in range(2)).backward()
        optimizer.step()
    results = unwrap(run_ranks(2, _train_two_groups, stage, timeout=120))
    assert_ranks_match_reference(results, snapshot(model), 1e-6, f"stage {stage}")
