"""Tiny models and a deterministic training loop shared by the tests.

The model has what the brief asks every test to cover: uneven sizes, a
tensor smaller than any world size, an empty tensor, tied input/output
embeddings, modules called twice per forward, a parameter never used and one
used only on some steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

VOCAB, WIDTH, HIDDEN, SEQ = 11, 6, 13, 5
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4: every rank gets equal tokens


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.scale = nn.Parameter(torch.ones(1))
        self.sometimes = nn.Parameter(torch.full((WIDTH,), 0.1))
        self.unused = nn.Linear(3, 2)
        self.empty = nn.Parameter(torch.zeros(0))

        # None, "reentrant" or "non_reentrant": run fc1 under activation checkpointing.
        self.checkpoint_mode: str | None = None

    def _fc1(self, h: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_mode is None:
            return self.fc1(h)
        return torch.utils.checkpoint.checkpoint(
            self.fc1, h, use_reentrant=self.checkpoint_mode == "reentrant"
        )

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        h = self.embed(tokens)
        for _ in range(2):  # fc1 and fc2 run twice
            h = self.fc2(torch.tanh(self._fc1(h))) * self.scale
        if step % 2 == 0:
            h = h + self.sometimes
        return self.head(torch.tanh(h))


def make_model(seed: int = 0, checkpoint_mode: str | None = None) -> TinyNet:
    torch.manual_seed(seed)
    model = TinyNet()
    model.checkpoint_mode = checkpoint_mode
    return model


def param_groups(model: TinyNet, lrs: tuple[float, float]) -> list[dict[str, Any]]:
    """Two groups with different hyper-parameters."""
    first = [model.embed.weight, model.fc1.weight, model.fc1.bias, model.empty]
    second = [
        model.fc2.weight,
        model.fc2.bias,
        model.scale,
        model.sometimes,
        model.unused.weight,
        model.unused.bias,
    ]
    return [{"params": first, "lr": lrs[0]}, {"params": second, "lr": lrs[1]}]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return tokens, targets


def local_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = global_batch(step)
    per_rank = GLOBAL_BATCH // world_size
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return tokens[sl], targets[sl]


def train(
    model: TinyNet,
    optimizer: torch.optim.Optimizer,
    steps: int,
    rank: int,
    world_size: int,
    first_step: int = 0,
    scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> None:
    """Runs ``steps`` steps; rank/world_size pick this rank's slice of the batch."""
    scheduler = scheduler_factory(optimizer) if scheduler_factory else None
    for step in range(first_step, first_step + steps):
        tokens, targets = local_batch(step, rank, world_size)
        optimizer.zero_grad()
        logits = model(tokens, step)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def gathered_snapshot(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The model's full parameters under a ZeroOptimizer (gathered at stage 3;
    collective)."""
    with optimizer.gathered_parameters():
        return snapshot(model)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max().item() if a[k].numel() else 0.0) for k in a)


def assert_ranks_match_reference(
    per_rank: list[dict[str, torch.Tensor]],
    expected: dict[str, torch.Tensor],
    tolerance: float,
    label: str,
) -> None:
    """Every rank within `tolerance` of the reference, and all ranks bit-identical."""
    for rank, params in enumerate(per_rank):
        diff = max_abs_diff(params, expected)
        print(f"{label} rank={rank}: max abs diff {diff:.3e}")
        assert diff <= tolerance, (label, rank, diff)
    for params in per_rank[1:]:
        assert max_abs_diff(params, per_rank[0]) == 0.0, label


class Block(nn.Module):
    """A transformer-like block: layer norm (called twice), token mixing, MLP."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.mlp_in = nn.Linear(width, hidden)
        self.mlp_out = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        # Causal mixing: each position sees the mean of the positions up to it.
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        x = x + self.mix(torch.cumsum(h, dim=1) / steps)
        return x + self.mlp_out(torch.tanh(self.mlp_in(self.ln(x))))


class TinyGPT(nn.Module):
    """Token embedding tied to the output head, a learned position table owned
    by the root, two blocks (the second optionally checkpointed), final norm."""

    def __init__(self, vocab: int = VOCAB, width: int = 8, hidden: int = 12, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Parameter(torch.randn(SEQ, width) * 0.1)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.checkpoint_mode: str | None = None
        # Run the blocks in reverse order on some steps and skip one on others.
        self.vary_order = False

    def forward(self, tokens: torch.Tensor, step: int = 0) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
        order = list(range(len(self.blocks)))
        if self.vary_order and step % 3 == 1:
            order.reverse()
        elif self.vary_order and step % 3 == 2:
            order = order[:1]
        for index in order:
            block = self.blocks[index]
            if self.checkpoint_mode is not None and index == len(self.blocks) - 1:
                x = torch.utils.checkpoint.checkpoint(
                    block, x, use_reentrant=self.checkpoint_mode == "reentrant"
                )
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def make_gpt(
    seed: int = 0, checkpoint_mode: str | None = None, vary_order: bool = False, **sizes: int
) -> TinyGPT:
    torch.manual_seed(seed)
    model = TinyGPT(**sizes)
    model.checkpoint_mode = checkpoint_mode
    model.vary_order = vary_order
    return model


class Optimizers(torch.optim.Optimizer):
    """Several torch.optim optimizers stepped as one: the single-process
    reference for a ZeroOptimizer whose groups run different rules."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()
