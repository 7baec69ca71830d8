"""``ZeroOptimizer.state``: torch.optim's ``optimizer.state[p]`` over a sharded state.

Each rank holds the optimizer state of the elements it owns only, so
``optimizer.state[p]`` answers with this rank's part of ``p``'s state, as
FSDP2's sharded state does (there a ``DTensor`` shard): see
:class:`ShardedOptimizerState`. Nothing here is a collective.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from zeroshard.update_rules import step_value

# The built-in rules whose torch.optim counterparts keep a "step" per parameter.
_COUNTS_STEPS = ("adam", "adamw")


def state_format(optimizer: Any, group: int) -> tuple[Any, dict[str, torch.dtype]]:
    """How torch.optim's class keeps a parameter's state in ``group``: its
    ``"step"`` (a dtype, ``int`` for a Python count, None: it keeps none; see
    ``update_rules.step_value``) and its per-parameter scalars by
    name (the core stores them in every element: [Note: a torch.optim class
    on pieces] in update_rules.py)."""
    rule = optimizer._rules[group] if optimizer._rules is not None else None
    if rule is None:
        return (torch.float32 if optimizer._kind in _COUNTS_STEPS else None), {}
    if not hasattr(rule, "state_format"):  # a C++ rule (Muon): no step, no scalars
        return None, {}
    return rule.state_format(optimizer._hyperparameters()[group])


class ParameterState(MutableMapping[str, Any]):
    """``optimizer.state[p]`` of one parameter: this rank's part of it.

    Keys are torch.optim's (``"step"``, ``"exp_avg"``, ``"exp_avg_sq"``,
    ``"max_exp_avg_sq"``; ``"momentum_buffer"`` for SGD), present once the
    parameter has been updated. Each moment is a 1-D fp32 tensor of the
    elements of ``p.flatten()`` this rank owns, ``[start, end)`` of
    :meth:`ZeroOptimizer.state_range`, empty where it owns none; ``"step"``
    is a float32 scalar tensor, as torch.optim's. Values are copies read at
    each access (an offloaded state has no tensor to view): editing one in
    place changes nothing; assigning ``state[p]["exp_avg"] = values`` (as
    many elements as the part) writes them into the optimizer. ``"step"``
    cannot be changed (assigning the value it has is accepted).
    """

    def __init__(
        self,
        impl: Any,
        step_dtype: Any,
        scalars: dict[str, torch.dtype],
        group: int,
        index: int,
    ) -> None:
        self._impl = impl
        self._step_dtype = step_dtype
        self._scalars = scalars
        self._where = (group, index)

    def _read(self) -> dict[str, Any]:
        _, _, steps, states = self._impl.parameter_state(*self._where)
        out: dict[str, Any] = {}
        if steps > 0 and self._step_dtype is not None:
            out["step"] = step_value(self._step_dtype, steps)
        for name, values in states.items():
            dtype = self._scalars.get(name)
            # A scalar a rank owns no element of reads as absent: it holds none of it.
            if dtype is None:
                out[name] = values
            elif values.numel() > 0:
                out[name] = values[0].to(dtype)
        return out

    def __getitem__(self, key: str) -> Any:
        return self._read()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "step":
            current = self._read().get("step")
            if current is not None and float(value) == float(current):
                return  # a round trip of what was read (moving the state to a device)
            raise ValueError(
                "optimizer.state[p]['step'] is the optimizer's own count of p's updates and "
                "cannot be written; load_state_dict() or load_checkpoint() restore it"
            )
        values = torch.as_tensor(value)
        if key in self._scalars and values.dim() == 0:
            # A per-parameter scalar, stored in every element this rank owns.
            numel = self._impl.parameter_state(*self._where, read_states=False)[1]
            values = torch.full((int(numel),), float(values))
        self._impl.write_parameter_state(*self._where, key, values)

    def __delitem__(self, key: str) -> None:
        raise TypeError(
            "zeroshard.ZeroOptimizer's optimizer.state[p] entries cannot be deleted: the "
            "state of every parameter lives in one sharded buffer"
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return f"ParameterState({self._read()!r})"


class ShardedOptimizerState(MutableMapping[torch.Tensor, ParameterState]):
    """``ZeroOptimizer.state``: ``{parameter: ParameterState}`` for the
    parameters updated so far (torch.optim's laziness), every rank alike;
    each value is this rank's part (see :class:`ParameterState`)."""

    def __init__(self, optimizer: Any) -> None:
        # Weak: the optimizer holds this mapping, and a cycle would keep it
        # (and its C++ core, whose destructor finishes an asynchronous save)
        # alive past its last use until the garbage collector runs.
        self._optimizer_ref = weakref.ref(optimizer)
        self._index: dict[int, tuple[int, int]] = {}

    @property
    def _optimizer(self) -> Any:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise RuntimeError("the ZeroOptimizer of this optimizer.state is gone")
        return optimizer

    def _where(self, p: Any) -> tuple[int, int] | None:
        groups = self._optimizer.param_groups
        where = self._index.get(id(p))
        if where is not None and groups[where[0]]["params"][where[1]] is p:
            return where
        # Parameters may have been replaced (stage 3 materializes meta ones).
        self._index = {
            id(q): (g, i) for g, group in enumerate(groups) for i, q in enumerate(group["params"])
        }
        return self._index.get(id(p))

    def _impl(self) -> Any:
        impl = self._optimizer._impl
        if impl is None:
            raise RuntimeError("this ZeroOptimizer was released (interpreter exit)")
        return impl

    def _stepped(self, where: tuple[int, int]) -> bool:
        return self._impl().parameter_state(*where, read_states=False)[2] > 0

    def __getitem__(self, p: torch.Tensor) -> ParameterState:
        where = self._where(p)
        if where is None:
            raise KeyError("optimizer.state[p]: p is not a parameter of this ZeroOptimizer")
        # A parameter not updated yet reads as empty, as torch.optim's
        # defaultdict(dict) gives.
        return ParameterState(self._impl(), *state_format(self._optimizer, where[0]), *where)

    def __setitem__(self, p: torch.Tensor, values: Mapping[str, Any]) -> None:
        state = self[p]
        for key, value in values.items():
            state[key] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        raise TypeError(
            "zeroshard.ZeroOptimizer's optimizer.state entries cannot be deleted: the "
            "state of every parameter lives in one sharded buffer"
        )

    def __iter__(self) -> Iterator[torch.Tensor]:
        for g, group in enumerate(self._optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if self._stepped((g, i)):
                    yield p

    def __contains__(self, p: object) -> bool:
        where = self._where(p)
        return where is not None and self._stepped(where)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"ShardedOptimizerState({len(self)} parameters with state on this rank's part)"


def state_range(impl: Any, where: tuple[int, int]) -> tuple[int, int]:
    """``[start, end)`` of the flattened parameter at ``where`` this rank owns."""
    start, numel, _, _ = impl.parameter_state(*where, read_states=False)
    return (int(start), int(start + numel))
