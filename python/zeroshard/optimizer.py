"""``zeroshard.ZeroOptimizer``: a ``torch.optim.Optimizer`` whose work runs in C++.

The Python object owns ``param_groups`` (so ``torch.optim.lr_scheduler`` and
edits of ``param_groups[i]["lr"]`` work unchanged) and hands the current
hyper-parameters to the C++ core at every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from zeroshard import _C

# Hyper-parameters each inner optimizer accepts, with torch.optim's defaults.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False},
    "adamw": {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 1e-2,
        "amsgrad": False,
    },
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
}

_STATE_KEY = "zeroshard_shard"


def _canonical_optimizer(name: str) -> str:
    key = name.lower() if isinstance(name, str) else name
    if key not in _DEFAULTS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {sorted(_DEFAULTS)}")
    return key


def _plain(value: Any) -> Any:
    """Turns tensors (torch allows a Tensor lr) into Python numbers for C++."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple | list):
        return tuple(_plain(v) for v in value)
    return value


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO optimizer: shards the optimizer state across the ranks of a process group.

    Args:
        params: parameters or parameter-group dicts, as for any torch.optim optimizer.
        optimizer: the inner optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"``.
        stage: ZeRO stage. 1 shards the optimizer state; gradients are
            averaged inside ``step()``. 2 also shards the gradients: autograd
            hooks reduce-scatter them bucket by bucket during backward and
            release each parameter's ``.grad``, so after backward ``.grad`` is
            None and each rank holds only its gradient shard.
        process_group: the group to shard over; the default group when None
            (``torch.distributed.init_process_group`` must have been called).
        reduce_bucket_size: elements per gradient bucket (DeepSpeed's key; the
            default 5e6 lets stage 2 overlap backward, where DeepSpeed's 5e8
            makes most models a single bucket).
        broadcast_from_rank: rank whose initial parameters every rank adopts.
        max_norm: clip gradients to this global L2 norm inside ``step()``
            (None: no clipping); see also ``clip_grad_norm_``.
        max_buckets_in_flight: gradient buckets whose collectives may be
            outstanding at once (bounds staging memory).
        overlap_comm: stage 2 launches each bucket's reduce-scatter as soon as
            it is complete, during backward; False waits for the end of backward.
        fused: Adam/AdamW through ATen's fused kernel, as torch.optim's
            ``fused=True`` (same results as ``torch.optim.AdamW(fused=True)``;
            several times faster on CPU than the default path).
        **optimizer_kwargs: the inner optimizer's hyper-parameters (lr, betas,
            eps, weight_decay, amsgrad; or lr, momentum, dampening,
            weight_decay, nesterov for SGD).

    Every rank must construct it with the same parameters and call ``step()``
    together. The model's parameters become views into one flat buffer per
    group; they keep their values, shapes and identities.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer: str = "adamw",
        stage: int = 1,
        process_group: dist.ProcessGroup | None = None,
        *,
        reduce_bucket_size: int = 5_000_000,
        broadcast_from_rank: int = 0,
        max_norm: float | None = None,
        max_buckets_in_flight: int = 2,
        overlap_comm: bool = True,
        fused: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        kind = _canonical_optimizer(optimizer)
        unknown = set(optimizer_kwargs) - set(_DEFAULTS[kind])
        if unknown:
            raise TypeError(
                f"unexpected keyword argument(s) {sorted(unknown)} for optimizer {kind!r}; "
                f"it accepts {sorted(_DEFAULTS[kind])}"
            )
        defaults = dict(_DEFAULTS[kind], **optimizer_kwargs)
        self._impl: Any = None
        super().__init__(params, defaults)
        for group in self.param_groups:
            extra = set(group) - set(_DEFAULTS[kind]) - {"params", "initial_lr"}
            if extra:
                raise ValueError(
                    f"parameter group has unknown key(s) {sorted(extra)} for optimizer "
                    f"{kind!r}; it accepts {sorted(_DEFAULTS[kind])}"
                )
        if process_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "zeroshard.ZeroOptimizer needs a process group: call "
                    "torch.distributed.init_process_group() first (torchrun sets up the "
                    "environment for it) or pass process_group="
                )
            process_group = dist.group.WORLD
        self._kind = kind
        self._stage = stage
        self._process_group = process_group
        self._impl = _C.ZeroOptimizer(
            [list(group["params"]) for group in self.param_groups],
            process_group,
            kind,
            self._hyperparameters(),
            stage,
            int(reduce_bucket_size),
            int(broadcast_from_rank),
            float(max_norm or 0.0),
            int(max_buckets_in_flight),
            bool(overlap_comm),
            bool(fused),
        )

    def _hyperparameters(self) -> list[dict[str, Any]]:
        keys = _DEFAULTS[self._kind]
        return [{k: _plain(group[k]) for k in keys} for group in self.param_groups]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group during construction; afterwards the layout is fixed."""
        if getattr(self, "_impl", None) is not None:
            raise RuntimeError(
                "zeroshard.ZeroOptimizer cannot add parameter groups after construction: "
                "the partition layout is fixed; pass all groups to the constructor"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Collective: averages gradients across ranks and updates the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._impl.set_hyperparameters(self._hyperparameters())
        self._impl.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears ``.grad`` of every parameter and, at stage 2, the gradient shard."""
        super().zero_grad(set_to_none)
        if self._impl is not None:
            self._impl.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Collective: clips the gradients to a global L2 norm; returns the total norm.

        Equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. Call it
        between backward and ``step()`` on every rank (at stage 2 ``.grad`` is
        released, so ``torch.nn.utils.clip_grad_norm_`` would see no gradients).
        """
        return self._impl.clip_grad_norm(float(max_norm))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate into ``.grad`` with no communication.

        As ``DistributedDataParallel.no_sync``: use it for the micro-steps before
        an accumulation boundary; the first backward outside it (or ``step()``)
        reduces everything accumulated. Costs a full gradient's memory meanwhile.
        """
        previous = self._impl.gradient_sync()
        self._impl.set_gradient_sync(False)
        try:
            yield
        finally:
            self._impl.set_gradient_sync(previous)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard plus the hyper-parameters; save one file per rank."""
        base = super().state_dict()
        return {
            "state": {},
            "param_groups": base["param_groups"],
            _STATE_KEY: self._impl.shard_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective: restores a state saved by ``state_dict()`` on the same rank."""
        if _STATE_KEY not in state_dict:
            raise ValueError(
                "not a zeroshard.ZeroOptimizer state dict (no "
                f"{_STATE_KEY!r} entry); load what ZeroOptimizer.state_dict() saved"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"state dict has {len(groups)} parameter groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        self._impl.load_shard_state(state_dict[_STATE_KEY])
        for group, saved in zip(self.param_groups, groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value

    # Measuring and introspection -------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (fp32 master + inner state)."""
        return int(self._impl.optimizer_state_bytes())

    def gradient_bytes(self) -> int:
        """Bytes of gradients held now: shard, live staging buffers, any ``.grad``."""
        return int(self._impl.gradient_bytes())

    def peak_staging_bytes(self) -> int:
        """Largest gradient staging footprint since the last reset."""
        return int(self._impl.peak_staging_bytes())

    def reset_peak_staging_bytes(self) -> None:
        """Restarts peak tracking of the gradient staging buffers."""
        self._impl.reset_peak_staging_bytes()

    def comm_stats(self) -> dict[str, int]:
        """Bytes handed to collectives since construction or the last reset."""
        return dict(self._impl.comm_stats())

    def reset_comm_stats(self) -> None:
        """Zeroes the collective byte counters."""
        self._impl.reset_comm_stats()

    def set_event_log_enabled(self, enabled: bool) -> None:
        """Records every collective launch and wait while enabled."""
        self._impl.set_event_log_enabled(enabled)

    def event_log(self) -> list[tuple[str, str, int, str]]:
        """(event, collective, bytes, tag) in issue order."""
        return list(self._impl.event_log())
