"""Gradient clipping across several ZeroOptimizers of one model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zeroshard.optimizer import ZeroOptimizer

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(optimizers: Sequence[ZeroOptimizer], max_norm: float) -> torch.Tensor:
    """Collective: clips the gradients of several optimizers of one model by their joint norm.

    As ``torch.nn.utils.clip_grad_norm_`` over all their parameters: e.g. the
    dense and the expert parameters of a mixture-of-experts model, each
    optimizer over its own data-parallel group. Returns the total norm. Every
    rank passes the same optimizers in the same order; build them with
    ``max_norm=None``.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    norms = [optimizer._impl.gradient_norm() for optimizer in optimizers]
    total = torch.stack(norms).norm()
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for optimizer in optimizers:
        optimizer._impl.scale_gradients(coefficient)
    return total
