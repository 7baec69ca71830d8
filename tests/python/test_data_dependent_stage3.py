"""Stage 3 when ranks run different modules: data-dependent routing.

The model is the one a new user writes: the root module holds a router and an
``nn.ModuleList`` of experts, no recognised MoE class, and routes each sample
by its data; some experts get no sample on some ranks, every expert gets
samples somewhere over the run. Options make an expert run a second time on
some samples (a module called a different number of times on each rank) and
take a branch on one rank only. With ``stage3_param_persistence_threshold=0``
and the default unit policy every expert is a unit of its own, so the ranks'
gathers and gradient reductions differ from step to step; they agree on each
one ([Note: Negotiated collectives] in collective_agreement.h).

The yardstick is single-process torch.optim on the global batch. Adam turns
reduction-order noise on near-zero gradients into lr-sized steps, so where the
1e-6 bound is not met the test requires zeroshard to be no further from
single-process than DDP (find_unused_parameters=True) on the same ranks.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import SEQ, VOCAB, make_gpt, max_abs_diff, snapshot

WIDTH = 8
EXPERTS = 4
BATCH = 12  # samples per step: divisible by 2 and 3
STEPS = 10
TOLERANCE = 1e-6
LR = 1e-2


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class RoutedExperts(nn.Module):
    """Top-1 routing over a plain ModuleList of experts, by each sample's data.

    ``twice``: samples whose feature 1 is positive go through their expert a
    second time. ``branch``: samples whose feature 2 is above 2 go through
    ``refine`` (the data puts such a sample on rank 0 only, on even steps).
    Every rule is per sample, so the global batch on one process computes
    exactly what the ranks compute on their slices.
    """

    def __init__(self, twice: bool = False, branch: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.refine = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.twice = twice
        self.branch = branch
        self.experts_run: list[int] = []  # in the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        gates = torch.softmax(self.router(h), dim=-1)
        choice = gates.argmax(dim=-1)
        out = torch.zeros_like(h)
        self.experts_run = []
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue  # this expert runs nowhere in this batch, on this rank
            self.experts_run.append(e)
            y = expert(h[rows])
            if self.twice:
                again = (x[rows, 1] > 0).nonzero().squeeze(-1)
                if again.numel() > 0:
                    y = y.index_add(0, again, expert(y[again]))
            out = out.index_add(0, rows, y * gates[rows, e : e + 1])
        if self.branch:
            rows = (x[:, 2] > 2).nonzero().squeeze(-1)
            if rows.numel() > 0:
                out = out.index_add(0, rows, self.refine(out[rows]))
        return self.head(out)


def make_model(twice: bool, branch: bool) -> RoutedExperts:
    torch.manual_seed(0)
    return RoutedExperts(twice=twice, branch=branch)


def global_batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(BATCH, WIDTH, generator=g)
    x[:, 2] = x[:, 2].clamp(max=1.5)
    if step % 2 == 0:
        x[0, 2] = 3.0  # the branch: sample 0 is on rank 0 at every world size
    y = torch.randn(BATCH, 1, generator=g)
    return x, y


def local_batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, micro)
    per_rank = BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows], y[rows]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


# name: (twice, branch, micro-batches (the first ones under no_sync))
CONFIGS: dict[str, tuple[bool, bool, int]] = {
    "routed": (False, False, 1),
    "routed_twice_branch": (True, True, 1),
    "routed_no_sync": (True, True, 2),
}


def reference(name: str) -> dict[str, torch.Tensor]:
    twice, branch, accumulation = CONFIGS[name]
    model = make_model(twice, branch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            x, y = global_batch(step, micro)
            (loss_of(model, x, y) / accumulation).backward()
        optimizer.step()
    return snapshot(model)


def _train_steps(
    name: str,
    rank: int,
    world: int,
    model: RoutedExperts,
    forward: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]],
) -> list[list[int]]:
    """The training loop both zeroshard and DDP run; returns the experts each
    step's first micro-batch ran on this rank. Between forward and backward
    it all-reduces the loss for logging, a collective of the user's own that
    must not meet a rank still gathering (the end of forward is a barrier)."""
    accumulation = CONFIGS[name][2]
    experts_per_step = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            x, y = local_batch(step, micro, rank, world)
            loss = nn.functional.mse_loss(forward(x), y) / accumulation
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            with no_sync() if micro < accumulation - 1 else contextlib.nullcontext():
                loss.backward()
            if micro == 0:
                experts_per_step.append(model.experts_run)
        optimizer.step()
    return experts_per_step


def _train_zeroshard(rank: int, world: int, name: str) -> dict[str, Any]:
    model = make_model(*CONFIGS[name][:2])
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=3,
        module=model,
        stage3_param_persistence_threshold=0,
        lr=LR,
    )
    experts_per_step = _train_steps(name, rank, world, model, model, optimizer, optimizer.no_sync)
    gathered_after = optimizer.gathered_parameter_bytes()
    with optimizer.gathered_parameters():
        params = snapshot(model)
    return {
        "params": params,
        "experts": experts_per_step,
        "agreements": optimizer._impl.agreements(),
        "diverged": optimizer._impl.diverged_agreements(),
        "gathered_after": gathered_after,
    }


def _train_ddp(rank: int, world: int, name: str) -> dict[str, torch.Tensor]:
    model = make_model(*CONFIGS[name][:2])
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    _train_steps(name, rank, world, model, ddp, optimizer, ddp.no_sync)
    return snapshot(model)


def _train_all(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in CONFIGS:
            out[name] = _train_zeroshard(rank, world, name)
            out[name]["ddp"] = _train_ddp(rank, world, name)
    out["warnings"] = [str(w.message) for w in caught]
    return out


_RESULTS: dict[int, list[dict[str, Any]]] = {}


def trained(world: int) -> list[dict[str, Any]]:
    if world not in _RESULTS:
        _RESULTS[world] = unwrap(run_ranks(world, _train_all, timeout=300))
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_data_dependent_routing_matches_single_process(world: int, name: str) -> None:
    results = trained(world)
    expected = reference(name)
    # The run did diverge: some expert had no sample on some rank at some
    # step, and every expert had samples somewhere.
    per_rank = [r[name]["experts"] for r in results]
    assert any(
        set(per_rank[rank][step]) != set(range(EXPERTS))
        for rank in range(world)
        for step in range(STEPS)
    ), per_rank
    assert set().union(*(set(e) for rank in per_rank for e in rank)) == set(range(EXPERTS))
    for rank, r in enumerate(results):
        # The ranks asked for different gathers (the count round ran) ...
        assert r[name]["diverged"] > 0, (rank, r[name]["agreements"])
        # ... and nothing stays gathered between steps at threshold 0.
        assert r[name]["gathered_after"] == 0
        assert not [w for w in r["warnings"] if "INTERNAL ASSERT" in w], r["warnings"]
    for params in [r[name]["params"] for r in results][1:]:
        assert max_abs_diff(params, results[0][name]["params"]) == 0.0
    diff = max_abs_diff(results[0][name]["params"], expected)
    ddp_diff = max(max_abs_diff(r[name]["ddp"], expected) for r in results)
    print(f"world={world} {name}: zeroshard {diff:.3e}, DDP {ddp_diff:.3e} from single-process")
    # See the module docstring: DDP is the yardstick where 1e-6 is out of reach.
    assert diff <= max(TOLERANCE, ddp_diff), (diff, ddp_diff)


# ---- The common path costs no more than the order check did ---------------------


def _count_collectives(rank: int, world: int) -> dict[str, int]:
    model = make_gpt(seed=0)
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), "adamw", stage=3, module=model, stage3_param_persistence_threshold=0
    )
    for step in range(3):
        if step == 2:
            optimizer._impl.set_event_log_enabled(True)
        g = torch.Generator().manual_seed(step * world + rank)
        tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        logits = model(tokens)
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    log = optimizer._impl.event_log()
    launches = [tag for what, kind, _, tag in log if what == "launch"]
    small = {"agreement", "agreement_counts", "order_check"}
    return {
        "agreement": launches.count("agreement"),
        "counts": launches.count("agreement_counts"),
        "order_check": launches.count("order_check"),
        "collectives": len([t for t in launches if t not in small]),
    }


def test_agreeing_ranks_spend_fewer_small_all_reduces_than_the_order_check() -> None:
    """On the GPT every rank runs alike: one all-reduce of two integers per
    agreement, never the count round, and fewer of them than the order check,
    which preceded each collective with one."""
    for rank, counts in enumerate(unwrap(run_ranks(2, _count_collectives))):
        print(f"rank {rank}, one step: {counts}")
        assert counts["counts"] == 0
        small = counts["agreement"] + counts["order_check"]
        assert 0 < small < counts["collectives"], counts


# ---- What still cannot be done: a clear error on every rank ------------------------


def _extra_micro_batch_on_rank0(rank: int, world: int) -> str:
    model = make_model(twice=False, branch=False)
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), "adamw", stage=3, module=model, stage3_param_persistence_threshold=0
    )
    x, y = local_batch(0, 0, rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(2 if rank == 0 else 1):
                loss_of(model, x, y).backward()
            optimizer.step()
        except ValueError as error:
            text = str(error)
        else:
            text = "no error"
    assert not [w for w in caught if "INTERNAL ASSERT" in str(w.message)]
    return text


def test_ranks_running_a_different_number_of_passes_raise_on_every_rank() -> None:
    for rank, message in enumerate(unwrap(run_ranks(2, _extra_micro_batch_on_rank0, timeout=120))):
        print(f"rank {rank}: {message}")
        assert "at step 0" in message, message
        assert "same number of forward passes" in message, message
        assert "INTERNAL ASSERT" not in message


# ---- Leaf modules (DeepSpeed's set_z3_leaf_modules) -------------------------------


def make_wrapped() -> nn.Sequential:
    """The routed model one level down, so that a leaf unit can enclose it."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), RoutedExperts(twice=True, branch=True))


def test_set_leaf_modules_makes_one_unit_of_each_instance() -> None:
    model = make_wrapped()
    marked = zeroshard.set_leaf_modules(model, [RoutedExperts])
    assert marked == [model[1]]
    names = [unit.name for unit in zeroshard.units.plan_units(model)]
    assert names == ["0", "1"], names
    assert zeroshard.set_leaf_modules(make_wrapped(), ["RoutedExperts"]) != []
    with pytest.raises(ValueError, match="RoutedExperts"):
        zeroshard.set_leaf_modules(model, [nn.GRU])


def _train_wrapped(rank: int, world: int, leaf: bool) -> dict[str, Any]:
    model = make_wrapped()
    if leaf:
        zeroshard.set_leaf_modules(model, [RoutedExperts])
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=3,
        module=model,
        stage3_param_persistence_threshold=0,
        lr=LR,
    )
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = local_batch(step, 0, rank, world)
        loss_of(model, x, y).backward()
        optimizer.step()
    with optimizer.gathered_parameters():
        return {"params": snapshot(model), "diverged": optimizer._impl.diverged_agreements()}


def _train_wrapped_both(rank: int, world: int) -> dict[str, Any]:
    return {leaf: _train_wrapped(rank, world, leaf) for leaf in (False, True)}


def test_leaf_module_trains_alike_without_diverging() -> None:
    """A leaf unit gathers every expert on every rank: the agreements never
    differ; without the leaf they do. Both are within 1e-6 of single-process.
    They are not bit-identical to each other: the unit hooks add different
    nodes to the autograd graph, which changes the order in which autograd
    sums the contributions of a tensor used several times (the expert called
    twice), a last-bit difference (6e-8 measured)."""
    model = make_wrapped()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = global_batch(step)
        loss_of(model, x, y).backward()
        optimizer.step()
    expected = snapshot(model)
    results = unwrap(run_ranks(2, _train_wrapped_both))
    for r in results:
        assert r[True]["diverged"] == 0
        assert r[False]["diverged"] > 0
        leaf = max_abs_diff(r[True]["params"], expected)
        negotiated = max_abs_diff(r[False]["params"], expected)
        between = max_abs_diff(r[True]["params"], r[False]["params"])
        print(
            f"vs single-process: leaf {leaf:.3e}, negotiated {negotiated:.3e}; {between:.3e} apart"
        )
        assert leaf <= TOLERANCE, leaf
        assert negotiated <= TOLERANCE, negotiated


# ---- A rank whose backward delivers no gradient -----------------------------------


class Adapted(nn.Module):
    """A frozen base and head with a trainable adapter that only samples whose
    feature 0 is above 2 pass through (the data puts such a sample on rank 0
    only, on even steps): on those steps rank 1's backward reaches no
    trainable parameter, yet it must join the gradient round rank 0 runs."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.adapter = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        for frozen in (self.base, self.head):
            frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.base(x))
        rows = (x[:, 0] > 2).nonzero().squeeze(-1)
        if rows.numel() > 0:
            h = h.index_add(0, rows, self.adapter(h[rows]))
        return self.head(h)


def adapted_batch(step: int, rank: int | None, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    x[:, 0] = x[:, 0].clamp(max=1.5)
    if step % 2 == 0:
        x[0, 0] = 3.0  # sample 0: rank 0 at every world size
    if rank is not None:
        per_rank = BATCH // world
        x, y = (
            x[rank * per_rank : (rank + 1) * per_rank],
            y[rank * per_rank : (rank + 1) * per_rank],
        )
    return x.requires_grad_(True), y  # the loss needs a graph where no parameter is trained


def _train_adapted(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    model = Adapted()
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=3,
        module=model,
        stage3_param_persistence_threshold=0,
        unit_classes=(nn.Linear,),
        lr=LR,
    )
    for step in range(4):
        optimizer.zero_grad()
        loss_of(model, *adapted_batch(step, rank, world)).backward()
        optimizer.step()
    with optimizer.gathered_parameters():
        return snapshot(model)


def test_a_rank_whose_backward_reaches_no_trained_parameter_joins_the_round() -> None:
    torch.manual_seed(2)
    model = Adapted()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(4):
        optimizer.zero_grad()
        loss_of(model, *adapted_batch(step, None, 1)).backward()
        optimizer.step()
    expected = snapshot(model)
    for rank, params in enumerate(unwrap(run_ranks(2, _train_adapted, timeout=120))):
        diff = max_abs_diff(params, expected)
        print(f"rank {rank}: {diff:.3e} from single-process")
        assert diff <= TOLERANCE, diff


# ---- gathered_parameters nested under a modifier ----------------------------------


def _nested_modifier(rank: int, world: int) -> list[float]:
    model = make_model(twice=False, branch=False)
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), "adamw", stage=3, module=model, stage3_param_persistence_threshold=0
    )
    weight = model.experts[1].up.weight
    with optimizer.gathered_parameters([weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.5)
        with optimizer.gathered_parameters([weight]):  # nested: must not re-gather
            pass
    with optimizer.gathered_parameters([weight]):
        return weight.detach().flatten().tolist()


def test_a_nested_gather_keeps_the_modifier_ranks_edits() -> None:
    for rank, values in enumerate(unwrap(run_ranks(2, _nested_modifier))):
        assert set(values) == {0.5}, (rank, sorted(set(values))[:4])
