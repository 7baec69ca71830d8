"""Any ``torch.optim`` class whose state is per element, or per whole parameter
in shapes of its own (Adafactor), as the update rule of a ``ZeroOptimizer``.

:class:`TorchOptimizerRule` runs a ``torch.optim.Optimizer`` subclass on this
rank's pieces of the parameters: each piece of the fp32 master shard is one
parameter of the torch optimizer, with its gradient and its state as views
of the core's flat buffers (``_C.UpdateRule``; ``update_rule.h``). An
elementwise class (RAdam, Adagrad, RMSprop, NAdam, a third-party Lion) runs on
any piece; any other (Muon: Newton-Schulz on the whole matrix) runs on whole
parameters, which its group's layout gives one rank each ([Note: whole
parameters] in partition_layout.h). A class whose states have shapes of
their own (Adafactor's row and column statistics of a matrix) is factored:
the owner keeps them in those shapes, found per number of dimensions by one
step on a parameter of distinct sizes ([Note: parameter states] in
update_rule.h).

[Note: a torch.optim class on pieces]
torch.optim keeps its state per parameter object and creates it on the
parameter's first update. The pieces are new tensor objects at each step,
so the rule hands the torch optimizer each piece's state before the step
(views of the core's buffers, which it updates in place) and copies back
what the optimizer created or replaced after it. The core's buffers are the
one home of the state: checkpoints, resharding and ``optimizer.state[p]``
read them. A per-parameter scalar the class keeps (NAdam's ``mu_product``,
ASGD's ``eta`` and ``mu``) is stored in every element of a state of that
name; ``step`` is the core's own count of the parameter's updates.

Only a class whose update of an element depends on that element alone gives
single-process results on pieces: each class is checked once, by stepping a
matrix whole and as two flat pieces and comparing; one that differs (or
refuses flat pieces) runs on whole parameters ([Note: elementwise rules on
shards] in update_rule.h).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from zeroshard import _C

# What a refusal says zeroshard runs.
_SUPPORTED = (
    "zeroshard runs torch.optim classes whose state is per element or, for whole "
    "parameters, of the parameter's shape with some dimensions 1: elementwise ones (Adam, "
    "AdamW, SGD, RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop, a Lion) on "
    "pieces of parameters, others (Muon; Adafactor, its states in their own shapes) on whole "
    "parameters, one rank each; closures (LBFGS) are not supported yet"
)


def rule_name(cls: type) -> str:
    """What checkpoints and messages call a class: ``torch.optim.RAdam`` for
    torch's own, else its module and qualified name."""
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def step_value(step_dtype: Any, count: int) -> Any:
    """A step count as the class keeps it: a tensor of ``step_dtype`` (torch's
    classes), or a Python int where ``step_dtype`` is ``int`` (transformers'
    Adafactor)."""
    if step_dtype is int:
        return int(count)
    return torch.tensor(float(count), dtype=step_dtype)


def _state_kind(value: Any, param: torch.Tensor) -> str:
    if isinstance(value, torch.Tensor) and value.shape == param.shape:
        return "element"
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return "scalar"
    return "other"


class _Layout(NamedTuple):
    """What a class keeps and how it runs, for one set of hyper-parameters."""

    names: list[str]  # its states per element, in the core's order
    scalars: dict[str, torch.dtype]  # those that are per-parameter scalars
    step_dtype: Any  # its "step": a torch.dtype, int (a Python int), None (none)
    whole: bool  # it needs each parameter whole ([Note: whole parameters])
    # It keeps states of shapes of their own (Adafactor's row and column
    # statistics): then all its tensor states are parameter states, held by
    # the owner in their shapes ([Note: parameter states] in update_rule.h).
    factored: bool = False


# Distinct sizes >= 2 per dimension, so that each dimension of a state is told
# apart as the parameter's own or 1.
_SIGNATURE = (2, 3, 5, 7, 11, 13)


class TorchOptimizerRule(_C.UpdateRule):
    """The update rule of one ``torch.optim.Optimizer`` subclass (see the module
    docstring). Construction checks how the class runs: elementwise, or on
    whole parameters."""

    def __init__(self, cls: type[torch.optim.Optimizer]) -> None:
        _C.UpdateRule.__init__(self)
        self._cls = cls
        self._name = rule_name(cls)
        # By _layout_key: a scheduler changing lr (or betas) every step
        # does not re-probe.
        self._layouts: dict[str, _Layout] = {}
        self._checked_shapes: set[tuple[str, int]] = set()
        # A factored class's parameter states per number of dimensions: each
        # state's name and, per dimension of it, the parameter's dimension it
        # has (-1: a dimension of 1).
        self._patterns: dict[tuple[str, int], list[tuple[str, list[int]]]] = {}

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        return self._cls

    # ---- _C.UpdateRule ----
    def name(self) -> str:
        return self._name

    def state_names(self, hyperparameters: str) -> list[str]:
        return self._layout(json.loads(hyperparameters)).names

    def validate(self, hyperparameters: str) -> None:
        self._layout(json.loads(hyperparameters))

    def whole_parameters(self, hyperparameters: str) -> bool:
        return self._layout(json.loads(hyperparameters)).whole

    def update_cost(self, sizes: list[int], hyperparameters: str) -> float:
        """A whole parameter's update work, which balances the owners ([Note:
        whole parameters]): Newton-Schulz's m * n * min(m, n) for a Muon
        subclass, else the parameter's elements."""
        muon = getattr(torch.optim, "Muon", None)
        if muon is not None and issubclass(self._cls, muon) and len(sizes) == 2:
            return float(sizes[0] * sizes[1] * min(sizes))
        return float(math.prod(sizes))

    def check_parameter(self, sizes: list[int], hyperparameters: str) -> None:
        """A whole-parameter class on a small tensor of the parameter's number of
        dimensions (Muon refuses anything but matrices): at construction, on
        every rank, not at the step on the parameter's owner alone."""
        values = json.loads(hyperparameters)
        if not self._layout(values).whole:
            return  # an elementwise class runs on flat pieces of any shape
        if self._layout(values).factored:
            self._pattern(values, len(sizes))  # its states' shapes, refused here if unfit
        key = (_layout_key(values), len(sizes))
        if key in self._checked_shapes:
            return
        shape = [min(int(d), 3) for d in sizes]
        try:
            _run(self._cls, [torch.zeros(shape)], _probe_values(values), steps=1)
        except Exception as error:
            raise ValueError(f"{type(error).__name__}: {error}") from error
        self._checked_shapes.add(key)

    def parameter_states(
        self, sizes: list[int], hyperparameters: str
    ) -> list[tuple[str, list[int]]]:
        """A factored class's states of a parameter of ``sizes``, in their shapes
        ([Note: parameter states] in update_rule.h); none for any other."""
        values = json.loads(hyperparameters)
        if not self._layout(values).factored:
            return []
        return [
            (name, [sizes[d] if d >= 0 else 1 for d in dims])
            for name, dims in self._pattern(values, len(sizes))
        ]

    def _pattern(self, values: dict[str, Any], ndim: int) -> list[tuple[str, list[int]]]:
        """Which of a parameter's dimensions each tensor state of a factored class
        has, for parameters of ``ndim`` dimensions: found by one step on a
        parameter of distinct sizes (torch's Adafactor keeps [m, 1] and
        [1, n] of a matrix, transformers' [m] and [n])."""
        key = (_layout_key(values), ndim)
        pattern = self._patterns.get(key)
        if pattern is not None:
            return pattern
        if ndim > len(_SIGNATURE):
            raise ValueError(f"optimizer {self._name}: parameters of {ndim} dimensions")
        shape = list(_SIGNATURE[:ndim])
        params, optimizer = _run(self._cls, [torch.zeros(shape)], _probe_values(values), steps=1)
        pattern = []
        for name, value in optimizer.state[params[0]].items():
            if name == "step" or not isinstance(value, torch.Tensor):
                continue  # the count, or a number the class recomputes each step
            # Each dimension is one of the parameter's (in order) or 1.
            dims: list[int] = []
            for size in value.shape:
                after = max(dims, default=-1)
                later = [d for d, extent in enumerate(shape) if extent == size and d > after]
                dims.append(later[0] if later else (-1 if size == 1 else -2))
            if -2 in dims:
                raise ValueError(
                    f"optimizer {self._name} keeps state {name!r} as {list(value.shape)} for a "
                    f"{shape} parameter: zeroshard keeps a factored class's states in shapes made "
                    "of the parameter's dimensions, in order, and 1s (Adafactor's [m, 1] and "
                    "[1, n], or [m] and [n]); " + _SUPPORTED
                )
            pattern.append((name, dims))
        self._patterns[key] = pattern
        return pattern

    def update(self, hyperparameters: str, pieces: Sequence[Any]) -> None:
        values = json.loads(hyperparameters)
        layout = self._layout(values)

        def shaped(t: torch.Tensor, piece: Any) -> torch.Tensor:
            return t.view(piece.sizes) if layout.whole else t

        params = []
        kept = []  # per piece: (name, the core's tensor as the class keeps it)
        names_by_ndim: dict[int, list[str]] = {}  # a factored class's, looked up once
        for piece in pieces:
            # A fresh view of the master: a parameter object for this step
            # only ([Note: a torch.optim class on pieces]).
            p = shaped(piece.param, piece)
            p.grad = shaped(piece.grad, piece)
            params.append(p)
            if layout.factored:  # whole parameters, states in their own shapes
                ndim = len(piece.sizes)
                if ndim not in names_by_ndim:
                    names_by_ndim[ndim] = [n for n, _ in self._pattern(values, ndim)]
                kept.append(list(zip(names_by_ndim[ndim], piece.parameter_states, strict=True)))
            else:
                states = [shaped(t, piece) for t in piece.states]
                kept.append(list(zip(layout.names, states, strict=True)))
        optimizer = self._cls(params, **values)
        for p, piece, own in zip(params, pieces, kept, strict=True):
            if piece.step == 1:
                continue  # torch.optim creates the state on the first update
            state = optimizer.state[p]
            if layout.step_dtype is not None:
                state["step"] = step_value(layout.step_dtype, piece.step - 1)
            for name, stored in own:
                dtype = layout.scalars.get(name)
                state[name] = stored if dtype is None else stored.reshape(-1)[0].to(dtype)
        optimizer.step()
        for p, own in zip(params, kept, strict=True):
            state = optimizer.state[p]
            for name, stored in own:
                new = state[name]
                if name in layout.scalars:
                    stored.fill_(new.item())
                elif new.data_ptr() != stored.data_ptr():
                    stored.copy_(new.reshape(stored.shape))

    def state_format(self, hyperparameters: dict[str, Any]) -> tuple[Any, dict[str, torch.dtype]]:
        """How the class keeps its ``"step"`` (a dtype, ``int`` for a Python
        count, None: it keeps none) and its per-parameter scalar states, for
        ``optimizer.state[p]``."""
        layout = self._layout(hyperparameters)
        return layout.step_dtype, dict(layout.scalars)

    # ---- the check of the class ----
    def _layout(self, hyperparameters: dict[str, Any]) -> _Layout:
        key = _layout_key(hyperparameters)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._probe(hyperparameters)
            self._layouts[key] = layout
        return layout

    def _probe(self, hyperparameters: dict[str, Any]) -> _Layout:
        """Steps a 4x6 matrix whole, and the same values as two flat pieces, three
        times: an elementwise class gives the same bits, any other runs on whole
        parameters. Returns the states it keeps (see [Note: a torch.optim class
        on pieces])."""
        values = _probe_values(hyperparameters)
        generator = torch.Generator().manual_seed(0)
        start = torch.randn(4, 6, generator=generator)
        grads = [torch.randn(4, 6, generator=generator) for _ in range(3)]
        try:
            whole, whole_optimizer = _run(self._cls, [start.clone()], values, grads=grads)
        except Exception as error:
            raise ValueError(
                f"optimizer {self._name} with hyper-parameters {hyperparameters} could not be "
                f"run ({type(error).__name__}: {error}); " + _SUPPORTED
            ) from error
        try:
            flat = start.reshape(-1)
            pieces, _ = _run(
                self._cls,
                [flat[:10].clone(), flat[10:].clone()],
                values,
                grads=[[g.reshape(-1)[:10], g.reshape(-1)[10:]] for g in grads],
            )
            elementwise = torch.equal(whole[0].reshape(-1), torch.cat(pieces))
        except Exception:  # noqa: BLE001 - a class refusing 1-D pieces is not elementwise
            elementwise = False
        names: list[str] = []
        scalars: dict[str, torch.dtype] = {}
        step_dtype: Any = None
        kept = whole_optimizer.state[whole[0]]
        factored = not elementwise and any(
            _state_kind(v, whole[0]) == "other" and isinstance(v, torch.Tensor) and v.dim() > 0
            for v in kept.values()
        )
        for key, value in kept.items():
            kind = _state_kind(value, whole[0])
            if key == "step" and kind == "scalar":
                step_dtype = value.dtype
            elif key == "step" and isinstance(value, int) and not isinstance(value, bool):
                step_dtype = int  # a Python count (transformers' Adafactor)
            elif factored and isinstance(value, torch.Tensor) and value.dim() > 0:
                continue  # a parameter state: its shape is found per parameter (_pattern)
            elif factored and (
                (isinstance(value, int | float) and not isinstance(value, bool))
                or (isinstance(value, torch.Tensor) and value.dim() == 0)
            ):
                # A number the class recomputes each step (transformers'
                # Adafactor's "RMS"): not kept; the rebuild check below
                # refuses a class that carries one across steps.
                continue
            elif kind == "element":
                names.append(key)
            elif kind == "scalar" and value.dtype in (torch.float32, torch.float16, torch.bfloat16):
                names.append(key)
                scalars[key] = value.dtype
            else:
                shape = list(value.shape) if isinstance(value, torch.Tensor) else None
                raise ValueError(
                    f"optimizer {self._name} keeps state {key!r} as {type(value).__name__}"
                    + (f" of shape {shape} for a [4, 6] parameter" if shape is not None else "")
                    + ", neither an element per parameter element, a 16- or 32-bit scalar "
                    "nor (for a class that needs whole parameters) a tensor of the "
                    "parameter's dimensions; " + _SUPPORTED
                )
        layout = _Layout(names, scalars, step_dtype, whole=not elementwise, factored=factored)
        # The step rebuilds the class from these states: a class keeping more
        # (a step count in its param groups, a running total on itself) would
        # lose it silently; so would one that couples its parameters (a global
        # gradient norm, a shared statistic), since each rank's instance holds
        # its own parameters only.
        rebuilt = _rebuilt_each_step(self._cls, start, values, grads, layout)
        if not torch.equal(rebuilt, whole[0]):
            raise ValueError(
                f"optimizer {self._name} keeps state outside optimizer.state[p] (in its "
                "param_groups or on itself): zeroshard rebuilds the class at each step from "
                "each parameter's state and cannot carry it; " + _SUPPORTED
            )
        other_start = torch.randn(3, 5, generator=generator)
        other_grads = [torch.randn(3, 5, generator=generator) for _ in range(3)]
        together, _ = _run(
            self._cls,
            [start.clone(), other_start.clone()],
            values,
            grads=[[g, h] for g, h in zip(grads, other_grads, strict=True)],
        )
        apart, _ = _run(self._cls, [other_start.clone()], values, grads=other_grads)
        if not (torch.equal(together[0], whole[0]) and torch.equal(together[1], apart[0])):
            raise ValueError(
                f"optimizer {self._name} couples its parameters (a global norm or statistic "
                "over all of them): each rank holds some parameters only, so it would compute "
                "another value on each; " + _SUPPORTED
            )
        return layout


def _layout_key(hyperparameters: dict[str, Any]) -> str:
    """What decides the states a class keeps and how it runs: the flags and
    choices, and of each number whether it is zero (momentum 0 keeps no
    buffer). A scheduler moving lr, betas or momentum does not re-probe."""

    def shape(value: Any) -> Any:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, int | float):
            return value == 0
        if isinstance(value, list | tuple):
            return [shape(v) for v in value]
        return repr(value)

    return json.dumps({k: shape(v) for k, v in hyperparameters.items()}, sort_keys=True)


def _probe_values(hyperparameters: dict[str, Any]) -> dict[str, Any]:
    values = dict(hyperparameters)
    if isinstance(values.get("lr"), int | float) and values["lr"] == 0:
        values["lr"] = 1e-2  # lr 0 (a warm-up's start) would hide a class's coupling
    return values


def _rebuilt_each_step(
    cls: type[torch.optim.Optimizer],
    start: torch.Tensor,
    values: dict[str, Any],
    grads: list[torch.Tensor],
    layout: _Layout,
) -> torch.Tensor:
    """``start`` stepped as TorchOptimizerRule.update steps a parameter: a new
    instance of ``cls`` each step, given the states the core keeps (fp32, the
    scalars in every element) and the step count."""
    param = start.clone()
    kept: dict[str, torch.Tensor] = {}
    for step, grad in enumerate(grads, start=1):
        view = param.view(param.shape)  # a new parameter object, as each step's pieces
        view.grad = grad.clone()
        optimizer = cls([view], **values)
        if step > 1:
            state = optimizer.state[view]
            if layout.step_dtype is not None:
                state["step"] = step_value(layout.step_dtype, step - 1)
            for name, value in kept.items():
                dtype = layout.scalars.get(name)
                state[name] = value if dtype is None else value.to(dtype)
        optimizer.step()
        state = optimizer.state[view]
        # A factored class's states are all its tensors but the step.
        names = (
            [n for n, v in state.items() if n != "step" and isinstance(v, torch.Tensor)]
            if layout.factored
            else layout.names
        )
        for name in names:
            kept[name] = state[name].detach().float().clone()
    return param


def _run(
    cls: type[torch.optim.Optimizer],
    params: list[torch.Tensor],
    values: dict[str, Any],
    grads: list[Any] | None = None,
    steps: int = 3,
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """``steps`` steps of ``cls`` on ``params`` (each step's gradients: a tensor
    for one parameter, a list for several; random when None)."""
    optimizer = cls(params, **values)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        given = grads[step] if grads is not None else None
        for i, p in enumerate(params):
            if given is None:
                p.grad = torch.randn(p.shape, generator=generator)
            else:
                p.grad = (given if len(params) == 1 else given[i]).clone()
        optimizer.step()
    return params, optimizer
