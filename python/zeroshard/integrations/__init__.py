"""zeroshard inside the training libraries users already run.

- :mod:`zeroshard.integrations.hf`: ``ZeroTrainer``, a ``transformers.Trainer``
  that trains with a zeroshard optimizer built from a DeepSpeed-style config.
- :mod:`zeroshard.integrations.accelerate`: ``prepare`` for scripts launched
  with ``accelerate launch``.
- :mod:`zeroshard.integrations.lightning`: ``ZeroShardStrategy`` for
  Lightning's ``Trainer`` (and ``.fabric``'s for ``Fabric``).

All keep the model out of DistributedDataParallel (zeroshard reduces the
gradients itself), route clipping and the logged norm through zeroshard's
global norm, and save zeroshard checkpoints that resume at any world size.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

from torch import nn

from zeroshard.optimizer import ZeroOptimizer


def attach_no_sync(model: nn.Module, optimizer: ZeroOptimizer) -> None:
    """Gives ``model`` the ``no_sync()`` that accelerate's ``no_sync(model)`` looks up.

    By weak reference: the model must not keep the optimizer (and its process
    group) alive (see [Note: release at exit] in checkpointing.py).
    """
    ref = weakref.ref(optimizer)

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        live = ref()
        with live.no_sync() if live is not None else contextlib.nullcontext():
            yield

    model.no_sync = no_sync  # type: ignore[assignment]


def unwrap_optimizer(optimizer: object) -> ZeroOptimizer:
    """The ZeroOptimizer inside an accelerate ``AcceleratedOptimizer`` (or itself)."""
    inner: object = optimizer
    for _ in range(4):  # AcceleratedOptimizer nests one level; be generous
        if isinstance(inner, ZeroOptimizer):
            return inner
        inner = getattr(inner, "optimizer", None)
    raise TypeError(
        f"expected a zeroshard.ZeroOptimizer (or accelerate's wrapper of one), got "
        f"{type(optimizer).__name__}"
    )


def global_norm_clipper(optimizer: ZeroOptimizer) -> Callable[..., object]:
    """``clip_grad_norm_(parameters, max_norm, norm_type=2)`` over zeroshard's gradients."""
    ref = weakref.ref(optimizer)

    def clip_grad_norm_(parameters: object, max_norm: float, norm_type: float = 2.0) -> object:
        if float(norm_type) != 2.0:
            raise ValueError(
                f"zeroshard clips by the global L2 norm; norm_type={norm_type} is not supported"
            )
        live = ref()
        if live is None:
            raise RuntimeError("the zeroshard optimizer behind this clip_grad_norm_ is gone")
        return live.clip_grad_norm_(float(max_norm))

    return clip_grad_norm_


__all__ = ["attach_no_sync", "global_norm_clipper", "unwrap_optimizer"]
