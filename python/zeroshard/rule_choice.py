"""Which update rule each parameter group of a ``ZeroOptimizer`` runs.

``optimizer=`` and a group's ``"optimizer"`` key name a built-in rule
(``"adamw"``: the core's C++ kernels), a ``torch.optim`` class (run by the
kernels when they compute the same values, by the C++ Muon for
``torch.optim.Muon``, else by :class:`~zeroshard.update_rules.TorchOptimizerRule`),
with the class's own hyper-parameters; and what is refused, naming it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from typing import Any

import torch

from zeroshard import _C
from zeroshard.update_rules import TorchOptimizerRule, rule_name

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


def make_rule(cls: type[torch.optim.Optimizer]) -> Any:
    """The core's update rule for ``cls``: the C++ Muon for ``torch.optim.Muon``
    itself (the same values, op for op, without Python in the step; a
    subclass may change the math, so it runs as itself), else
    :class:`TorchOptimizerRule`."""
    if cls is getattr(torch.optim, "Muon", None):
        return _C.MuonRule()
    return TorchOptimizerRule(cls)


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


def update_rule_of(
    optimizer: str | type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    builtin_defaults: dict[str, dict[str, Any]],
) -> tuple[str, Any, dict[str, Any]]:
    """``optimizer=`` as (its name, the update rule or None for a built-in one,
    the hyper-parameters it accepts with their defaults). ``builtin_defaults``:
    the core's built-in rules and their hyper-parameters. Drops from ``kwargs``
    a built-in class's keywords the kernels need not see."""
    if isinstance(optimizer, str):
        kind = optimizer.lower()
        if kind not in builtin_defaults:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; expected one of {sorted(builtin_defaults)}"
            )
        return kind, None, dict(builtin_defaults[kind])
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer= takes a name ({sorted(builtin_defaults)}) or a torch.optim.Optimizer "
            f"subclass; got {optimizer!r}"
        )
    builtin = builtin_name(optimizer, kwargs, builtin_defaults)
    if builtin is not None:
        # Keywords the kernels ignore at these values (foreach, fused=False,
        # maximize=False, ...) are dropped with the class.
        for key in set(kwargs) - set(builtin_defaults[builtin]):
            del kwargs[key]
        return builtin, None, dict(builtin_defaults[builtin])
    return rule_name(optimizer), make_rule(optimizer), class_defaults(optimizer)


def group_rule(
    param_group: dict[str, Any], earlier: list[tuple[Any, list[str], type]]
) -> tuple[Any, list[str], type]:
    """The rule of a parameter group that names its own ``"optimizer"``: (the
    rule, shared with ``earlier`` groups of the same class; its
    hyper-parameter names; the class). Fills the group's missing
    hyper-parameters with the class's defaults."""
    cls = rule_class(param_group["optimizer"])
    own = class_defaults(cls)
    refuse_missing(rule_name(cls), own, param_group)
    for key, value in own.items():
        param_group.setdefault(key, value)
    shared = next((r for r in earlier if r[2] is cls), None)
    return (shared[0] if shared else make_rule(cls), list(own), cls)


def refuse_whole_parameters(
    rules: Sequence[Any], hyperparameters: Sequence[dict[str, Any]], why: str
) -> None:
    """Raises for a group whose rule updates whole matrices where each rank
    holds a slice of them (``why``: "tensor-parallel")."""
    for rule, hyper in zip(rules, hyperparameters, strict=True):
        if rule.whole_parameters(json.dumps(hyper)):
            raise ValueError(
                f"optimizer {rule.name()} updates whole matrices, and {why} (DTensor) "
                "parameters give each rank a slice of one: it would update each slice as a "
                "matrix of its own; not supported yet"
            )


def refuse_missing(name: str, accepted: dict[str, Any], given: dict[str, Any]) -> None:
    """Raises naming the hyper-parameters ``name``'s class requires (no default
    in ``accepted``) that ``given`` lacks."""
    missing = sorted(
        k for k, v in accepted.items() if v is inspect.Parameter.empty and given.get(k, v) is v
    )
    if missing:
        raise TypeError(f"optimizer {name} needs the hyper-parameter(s) {missing}")


def refuse_unknown_keys(
    groups: Sequence[dict[str, Any]], keys: Sequence[list[str]], name: str
) -> None:
    """Raises for a parameter group holding a key its rule does not take."""
    for group, accepted in zip(groups, keys, strict=True):
        # "param_names": torch.optim's record of named_parameters() input.
        extra = set(group) - set(accepted) - {"params", "param_names", "initial_lr", "optimizer"}
        if extra:
            raise ValueError(
                f"parameter group has unknown key(s) {sorted(extra)} for optimizer "
                f"{group.get('optimizer', name)!r}; it accepts {sorted(accepted)}"
            )
