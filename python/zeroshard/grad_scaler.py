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


class GradScalerProtocol:
    """What ``torch.amp.GradScaler`` calls on a ZeroOptimizer: the protocol of
    an optimizer that unscales itself (``_step_supports_amp_scaling``)."""

    _impl: Any
    _stage: int
    _clipped_since_step: bool

    def _unscale_for(self, scaler: torch.amp.GradScaler) -> None:
        """Divides the averaged gradients by ``scaler``'s scale and makes the
        coming step check them for inf/NaN (GradScaler's protocol for an
        optimizer with ``_step_supports_amp_scaling``)."""
        state = scaler._per_optimizer_states[id(self)]
        # After scaler.unscale_(optimizer), .grad (stage 1, no_sync) was
        # unscaled in place and its check recorded; with nothing recorded the
        # scaler found no .grad: the gradients are in the shard, still scaled.
        unscaled = bool(state["found_inf_per_device"])
        if not unscaled and self._clipped_since_step:
            raise RuntimeError(
                "zeroshard.ZeroOptimizer with torch.amp.GradScaler: clip_grad_norm_() ran on "
                "gradients still multiplied by the loss scale (scaler.unscale_(optimizer) "
                "cannot reach gradients held in the shard at stages 2 and 3); clip with "
                "ZeroOptimizer(max_norm=...) instead, which clips inside step() after the unscale"
            )
        if not unscaled:
            self._unscale_shards(scaler._scale.double().reciprocal())
        self._impl.check_next_step_for_overflow()

    @property
    def _gradients_in_shards(self) -> bool:
        """Whether backward leaves the gradients in the shards, not ``.grad``
        (stages 2-3): where ``GradScaler.unscale_`` is routed here."""
        return self._stage >= 2

    def _unscale_shards(self, inv_scale: torch.Tensor) -> None:
        """Reduces the gradients (if not yet) and multiplies the averaged
        gradient shards by ``inv_scale`` (a tensor: read on the host only by offload); the coming
        step checks them for inf/NaN ([Note: GradScaler's unscale_ routed])."""
        self._impl.scale_gradients(inv_scale)
        self._impl.check_next_step_for_overflow()

    def _record_found_inf(self, scaler: torch.amp.GradScaler) -> None:
        """Tells ``scaler`` whether the step was skipped: every rank's verdict
        (the ranks agreed on it), so every rank's scale moves alike."""
        scale = scaler._get_scale_async()
        device = scale.device if scale is not None else torch.device("cpu")
        found = 1.0 if self._impl.last_step_skipped() else 0.0
        scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {
            device: torch.full((), found, dtype=torch.float32, device=device)
        }
