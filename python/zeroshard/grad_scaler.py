"""``torch.amp.GradScaler.unscale_`` routed for gradients zeroshard holds in shards."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__: list[str] = []

# [Note: GradScaler's unscale_ routed]
# The usual recipe for clipping under a GradScaler is
#     scaler.scale(loss).backward(); scaler.unscale_(optimizer)
#     torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
#     scaler.step(optimizer); scaler.update()
# torch's unscale_ divides each .grad by the scale. At stages 2 and 3 a
# ZeroOptimizer's gradients are reduced into its shards and .grad is freed,
# so torch's unscale_ found nothing and the clip ran on scaled gradients.
# Routed, unscale_ of such an optimizer finishes the reduction and divides
# the shards by the scale (a device tensor, read on the host only by offload), and the coming
# step checks them for inf/NaN; every other call is torch's own (stage 1
# keeps .grad, which torch unscales in place before the step reduces it).
# The scaler's per-optimizer state records the unscale as torch's does, so
# step() does not divide twice and a second unscale_ raises as torch's does.


def _routed(torch_unscale: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(torch_unscale)
    def unscale_(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled or not getattr(optimizer, "_gradients_in_shards", False):
            return torch_unscale(self, optimizer)
        from torch.amp.grad_scaler import OptState

        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        optimizer._unscale_shards(self._scale.double().reciprocal())  # type: ignore[attr-defined]
        # Not a verdict (the step agrees on inf/NaN across ranks and tells
        # the scaler then): a record that the gradients are unscaled.
        state["found_inf_per_device"] = {
            self._scale.device: torch.zeros((), dtype=torch.float32, device=self._scale.device)
        }
        state["stage"] = OptState.UNSCALED

    unscale_._zeroshard_routed = True  # type: ignore[attr-defined]
    return unscale_


def route_grad_scaler_unscale() -> None:
    """Makes ``torch.amp.GradScaler.unscale_`` unscale the gradient shards of
    ZeroOptimizers at stages 2-3 ([Note: GradScaler's unscale_ routed]). Idempotent."""
    scaler: Any = torch.amp.GradScaler
    if getattr(scaler.unscale_, "_zeroshard_routed", False):
        return
    scaler.unscale_ = _routed(scaler.unscale_)
