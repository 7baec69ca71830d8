"""Any elementwise ``torch.optim`` class as the update rule of a ``ZeroOptimizer``.

:class:`TorchOptimizerRule` runs a ``torch.optim.Optimizer`` subclass (RAdam,
Adagrad, RMSprop, NAdam, a third-party Lion written the same way) on this
rank's pieces of the parameters: each piece of the fp32 master shard is one
parameter of the torch optimizer, with its gradient and its state as views
of the core's flat buffers (``_C.UpdateRule``; ``update_rule.h``).

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
matrix whole and as two flat pieces and comparing ([Note: elementwise rules
on shards] in update_rule.h).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from typing import Any

import torch

from zeroshard import _C

# torch.optim classes that are not elementwise, with what to use instead.
_NOT_ELEMENTWISE_HINT = (
    "zeroshard shards elementwise rules (Adam, AdamW, SGD, RMSprop, Adagrad, Adadelta, "
    "Adamax, NAdam, RAdam, ASGD, Rprop and third-party rules written the same way); rules "
    "that need whole matrices (Muon, Adafactor) or a closure (LBFGS) are not supported yet"
)

# The built-in rules' classes: run by the core's C++ kernels (the same values)
# when every hyper-parameter given is one the kernels take.
_BUILTIN_CLASSES: dict[type, str] = {
    torch.optim.Adam: "adam",
    torch.optim.AdamW: "adamw",
    torch.optim.SGD: "sgd",
}


def rule_class(optimizer: str | type) -> type[torch.optim.Optimizer]:
    """A parameter group's ``"optimizer"``: a ``torch.optim.Optimizer`` subclass, or
    the lower-case name of one of torch.optim's (``"radam"``, ``"adamw"``)."""
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, str):
        classes = {
            name.lower(): value
            for name, value in vars(torch.optim).items()
            if isinstance(value, type)
            and issubclass(value, torch.optim.Optimizer)
            and value is not torch.optim.Optimizer
        }
        found = classes.get(optimizer.lower())
        if found is not None:
            return found
        raise ValueError(
            f"unknown optimizer {optimizer!r} in a parameter group; expected a "
            f"torch.optim.Optimizer subclass or one of {sorted(classes)}"
        )
    raise TypeError(
        'a parameter group\'s "optimizer" is a torch.optim.Optimizer subclass or its '
        f"lower-case name; got {optimizer!r}"
    )


def builtin_class(name: str) -> type[torch.optim.Optimizer]:
    """torch.optim's class of a built-in rule's name."""
    return next(cls for cls, builtin in _BUILTIN_CLASSES.items() if builtin == name)


def rule_name(cls: type) -> str:
    """What checkpoints and messages call a class: ``torch.optim.RAdam`` for
    torch's own, else its module and qualified name."""
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def class_defaults(cls: type) -> dict[str, Any]:
    """The hyper-parameters ``cls.__init__`` takes after ``params``, with defaults
    (``inspect.Parameter.empty`` for those without)."""
    signature = inspect.signature(cls.__init__)
    out: dict[str, Any] = {}
    for name, parameter in list(signature.parameters.items())[2:]:
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        out[name] = parameter.default
    return out


def builtin_name(
    cls: type, hyperparameters: dict[str, Any], builtin_defaults: dict[str, dict[str, Any]]
) -> str | None:
    """The built-in rule (a key of ``builtin_defaults``, the core's names and
    hyper-parameters) that computes what ``cls`` does with these
    hyper-parameters, or None."""
    name = _BUILTIN_CLASSES.get(cls)
    if name is None:
        return None
    defaults = class_defaults(cls)
    for key, value in hyperparameters.items():
        if key in builtin_defaults[name]:
            continue
        # foreach/fused pick torch's implementation, not the values; others
        # (maximize, capturable, differentiable, decoupled_weight_decay) count
        # only at their defaults.
        if key in ("foreach", "fused") and not value:
            continue
        if key not in defaults or value != defaults[key]:
            return None
    return name


def _state_kind(value: Any, param: torch.Tensor) -> str:
    if isinstance(value, torch.Tensor) and value.shape == param.shape:
        return "element"
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return "scalar"
    return "other"


class TorchOptimizerRule(_C.UpdateRule):
    """The update rule of one ``torch.optim.Optimizer`` subclass (see the module
    docstring). Construction checks that the class is elementwise."""

    def __init__(self, cls: type[torch.optim.Optimizer]) -> None:
        _C.UpdateRule.__init__(self)
        self._cls = cls
        self._name = rule_name(cls)
        # By the hyper-parameters other than lr, as sorted JSON text (a
        # scheduler changes lr every step; the states a class keeps do not
        # follow it): (state names, per-parameter scalars' dtypes, the step's
        # dtype or None).
        self._layouts: dict[str, tuple[list[str], dict[str, torch.dtype], torch.dtype | None]] = {}

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        return self._cls

    # ---- _C.UpdateRule ----
    def name(self) -> str:
        return self._name

    def state_names(self, hyperparameters: str) -> list[str]:
        return self._layout(json.loads(hyperparameters))[0]

    def validate(self, hyperparameters: str) -> None:
        self._layout(json.loads(hyperparameters))

    def update(self, hyperparameters: str, pieces: Sequence[Any]) -> None:
        values = json.loads(hyperparameters)
        names, scalars, step_dtype = self._layout(values)
        params = []
        for piece in pieces:
            # The piece is a fresh view of the master: a parameter object for
            # this step only ([Note: a torch.optim class on pieces]).
            p = piece.param
            p.grad = piece.grad
            params.append(p)
        optimizer = self._cls(params, **values)
        for p, piece in zip(params, pieces, strict=True):
            if piece.step == 1:
                continue  # torch.optim creates the state on the first update
            state = optimizer.state[p]
            if step_dtype is not None:
                state["step"] = torch.tensor(float(piece.step - 1), dtype=step_dtype)
            for name, values in zip(names, piece.states, strict=True):
                dtype = scalars.get(name)
                state[name] = values if dtype is None else values[0].to(dtype).clone()
        optimizer.step()
        for p, piece in zip(params, pieces, strict=True):
            state = optimizer.state[p]
            for name, values in zip(names, piece.states, strict=True):
                new = state[name]
                if name in scalars:
                    values.fill_(new.item())
                elif new is not values:
                    values.copy_(new.reshape(-1))

    def state_format(
        self, hyperparameters: dict[str, Any]
    ) -> tuple[torch.dtype | None, dict[str, torch.dtype]]:
        """The dtype of the class's ``"step"`` (None: it keeps none) and its
        per-parameter scalar states, for ``optimizer.state[p]``."""
        _, scalars, step_dtype = self._layout(hyperparameters)
        return step_dtype, dict(scalars)

    # ---- the check of the class ----
    def _layout(
        self, hyperparameters: dict[str, Any]
    ) -> tuple[list[str], dict[str, torch.dtype], torch.dtype | None]:
        key = json.dumps({k: v for k, v in hyperparameters.items() if k != "lr"}, sort_keys=True)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._probe(hyperparameters)
            self._layouts[key] = layout
        return layout

    def _probe(
        self, hyperparameters: dict[str, Any]
    ) -> tuple[list[str], dict[str, torch.dtype], torch.dtype | None]:
        """Steps a 4x6 matrix whole, and the same values as two flat pieces, three
        times: an elementwise rule gives the same bits. Returns the states it
        keeps (see [Note: a torch.optim class on pieces])."""
        probe = dict(hyperparameters)
        if isinstance(probe.get("lr"), int | float) and probe["lr"] == 0:
            probe["lr"] = 1e-2  # lr 0 (a warm-up's start) would hide a rule's coupling
        generator = torch.Generator().manual_seed(0)
        whole = torch.randn(4, 6, generator=generator)
        pieces = [whole.reshape(-1)[:10].clone(), whole.reshape(-1)[10:].clone()]
        whole = whole.clone()
        try:
            with torch.enable_grad():
                whole_optimizer = self._cls([whole], **probe)
                pieces_optimizer = self._cls(pieces, **probe)
            for _ in range(3):
                grad = torch.randn(4, 6, generator=generator)
                whole.grad = grad.clone()
                pieces[0].grad = grad.reshape(-1)[:10].clone()
                pieces[1].grad = grad.reshape(-1)[10:].clone()
                whole_optimizer.step()
                pieces_optimizer.step()
        except Exception as error:
            raise ValueError(
                f"optimizer {self._name} with hyper-parameters {hyperparameters} could not be "
                f"run on flat pieces of a shard ({type(error).__name__}: {error}); "
                + _NOT_ELEMENTWISE_HINT
            ) from error
        if not torch.equal(whole.reshape(-1), torch.cat(pieces)):
            raise ValueError(
                f"optimizer {self._name} is not elementwise: its update of a matrix differs "
                "from its update of the matrix's elements in two pieces, and a shard holds "
                "pieces of parameters; " + _NOT_ELEMENTWISE_HINT
            )
        names: list[str] = []
        scalars: dict[str, torch.dtype] = {}
        step_dtype: torch.dtype | None = None
        for key, value in whole_optimizer.state[whole].items():
            kind = _state_kind(value, whole)
            if key == "step":
                if kind != "scalar":
                    raise ValueError(
                        f"optimizer {self._name} keeps its step as {type(value).__name__}; "
                        "zeroshard restores it as a scalar tensor, as torch.optim's classes keep it"
                    )
                step_dtype = value.dtype
            elif kind == "element":
                names.append(key)
            elif kind == "scalar":
                names.append(key)
                scalars[key] = value.dtype
            else:
                raise ValueError(
                    f"optimizer {self._name} keeps state {key!r} as {type(value).__name__}, "
                    "neither a tensor shaped like the parameter nor a scalar tensor; zeroshard "
                    "cannot shard it"
                )
        for key, dtype in scalars.items():
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(
                    f"optimizer {self._name} keeps the scalar {key!r} as {dtype}; zeroshard "
                    "stores per-parameter scalars in fp32, which would round it"
                )
        return names, scalars, step_dtype
