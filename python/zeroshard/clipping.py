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

    A non-finite joint norm (inf/NaN in any optimizer's gradients) skips the
    next ``step()`` of every optimizer given when any of them was built with
    ``skip_nonfinite_steps=True``, so the dense parameters do not step while
    the experts skip (``max_norm=float("inf")`` makes this the only effect).
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    norms = [optimizer._impl.gradient_norm() for optimizer in optimizers]
    total = torch.stack(norms).norm()
    if not torch.isfinite(total) and any(o._skip_nonfinite_steps for o in optimizers):
        # The norm is global, so every rank takes this branch alike.
        for optimizer in optimizers:
            optimizer._impl.skip_next_step()
        return total
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for optimizer in optimizers:
        optimizer._impl.scale_gradients(coefficient)
    return total
