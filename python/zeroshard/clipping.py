"""Gradient clipping across several ZeroOptimizers of one model, and
``torch.nn.utils.clip_grad_norm_`` routed to it for zeroshard's parameters."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

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
    return _clip(optimizers, max_norm, error_if_nonfinite=False)


def _clip(
    optimizers: Sequence[ZeroOptimizer], max_norm: float, error_if_nonfinite: bool
) -> torch.Tensor:
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    norms = [optimizer._impl.gradient_norm() for optimizer in optimizers]
    # One optimizer's norm as it is (the joint norm of one value could round).
    total = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
    if not torch.isfinite(total):
        if error_if_nonfinite:
            # The norm is global: every rank raises alike, before any scaling.
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by "
                "the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        if any(o._skip_nonfinite_steps for o in optimizers):
            # The norm is global, so every rank takes this branch alike.
            for optimizer in optimizers:
                optimizer._impl.skip_next_step()
            return total
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for optimizer in optimizers:
        optimizer._impl.scale_gradients(coefficient)
    return total


# [Note: torch's clip_grad_norm_ routed]
# After backward a ZeroOptimizer's gradients are not in .grad the way
# torch.nn.utils.clip_grad_norm_ expects: at stages 2-3 .grad is released
# (reduce-scattered into shards), so torch's helper returns 0 and clips
# nothing; at stage 1 .grad holds this rank's unreduced gradient, so it clips
# each rank by its own local norm. Every training script calls torch's helper,
# so zeroshard routes it: a call whose parameters belong to live
# ZeroOptimizers clips them by their global norm (_clip, as
# optimizer.clip_grad_norm_ does) and returns it, the same on every rank; any
# other call is torch's own. torch's public function is a no_grad wrapper
# around the implementation, held in the wrapper's closure: replacing the
# implementation there reaches every reference to the function, including
# `from torch.nn.utils import clip_grad_norm_` imported before zeroshard (a
# module attribute replaced would miss those). Where a torch release shapes
# the function otherwise, the module attributes are replaced instead and the
# docs name that limit. get_total_norm / clip_grads_with_norm_ take gradient
# tensors, not parameters, and are not routed.


def _owning_optimizers(params: list[torch.Tensor]) -> list[ZeroOptimizer]:
    """The live ZeroOptimizers holding ``params``, in the order their parameters
    first appear; raises where the call mixes them with parameters whose
    gradients zeroshard does not hold, or leaves out some of an optimizer's."""
    from zeroshard.checkpointing import _LIVE

    live = [o for o in list(_LIVE) if getattr(o, "_impl", None) is not None]
    if not live:
        return []
    owner_of = {pid: o for o in live for pid in getattr(o, "_param_ids", ())}
    owners: list[Any] = []
    passed: set[int] = set()
    strays = 0
    for p in params:
        owner = owner_of.get(id(p))
        if owner is None:
            strays += p.grad is not None
            continue
        passed.add(id(p))
        if owner not in owners:
            owners.append(owner)
    if not owners:
        return []
    if strays:
        raise ValueError(
            f"torch.nn.utils.clip_grad_norm_ got parameters of a zeroshard.ZeroOptimizer and "
            f"{strays} parameter(s) with a gradient that no ZeroOptimizer holds; zeroshard clips "
            "its optimizers' gradients by their global norm: clip those parameters separately, "
            "or give them to the ZeroOptimizer"
        )
    for optimizer in owners:
        missing = [
            p
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) not in passed and p.requires_grad
        ]
        if missing:
            names = {id(p): n for n, p in optimizer._param_names or ()}
            shown = [names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in missing[:3]]
            raise ValueError(
                f"torch.nn.utils.clip_grad_norm_ got some of a zeroshard.ZeroOptimizer's "
                f"parameters but not {len(missing)} others ({', '.join(shown)}); zeroshard "
                "clips an optimizer's gradients as a whole by their global norm: pass all of "
                "them (model.parameters()), or call optimizer.clip_grad_norm_(max_norm)"
            )
    return owners


def _routed(torch_clip: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch's ``clip_grad_norm_`` implementation, routed for zeroshard's parameters."""

    @functools.wraps(torch_clip)
    def clip_grad_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        elif not isinstance(parameters, list | tuple):
            parameters = list(parameters)  # a generator: read once, passed on as a list
        owners = _owning_optimizers(list(parameters))
        if not owners:
            return torch_clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        if float(norm_type) != 2.0:
            raise ValueError(
                f"torch.nn.utils.clip_grad_norm_ with norm_type={norm_type} over a "
                "zeroshard.ZeroOptimizer's parameters: zeroshard clips by the global L2 norm "
                "only (norm_type=2)"
            )
        max_norm = float(max_norm)
        if math.isnan(max_norm) or max_norm <= 0:
            raise ValueError(
                f"torch.nn.utils.clip_grad_norm_ over a zeroshard.ZeroOptimizer's parameters "
                f"needs max_norm > 0, got {max_norm}"
            )
        return _clip(owners, max_norm, error_if_nonfinite)

    clip_grad_norm_._zeroshard_routed = True  # type: ignore[attr-defined]
    return clip_grad_norm_


def route_torch_clip_grad_norm() -> None:
    """Makes ``torch.nn.utils.clip_grad_norm_`` clip zeroshard's parameters by their
    global norm ([Note: torch's clip_grad_norm_ routed]). Idempotent."""
    import torch.nn.utils
    from torch.nn.utils import clip_grad

    public = clip_grad.clip_grad_norm_
    if getattr(public, "_zeroshard_routed", False):
        return
    for cell in getattr(public, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(inner) and getattr(inner, "__name__", "") == "clip_grad_norm_":
            if not getattr(inner, "_zeroshard_routed", False):
                cell.cell_contents = _routed(inner)
            return
    routed = _routed(public)
    clip_grad.clip_grad_norm_ = routed  # also what the deprecated clip_grad_norm calls
    torch.nn.utils.clip_grad_norm_ = routed
