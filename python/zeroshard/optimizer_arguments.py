"""How ``ZeroOptimizer``'s arguments become the core's: the scalar ZeRO
options and their defaults and docs (from the core's one list), the inner
optimizers' hyper-parameters, the messages for misspelled ones, the store
keys each optimizer's collectives meet under, and named parameters.
"""

from __future__ import annotations

import difflib
import inspect
import itertools
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zeroshard import _C

# ZeroOptions' scalar options and their defaults, from the core ([Note: one
# list of the scalar options] in zero_options.h): each is a keyword argument
# of ZeroOptimizer of the same name (max_norm and gradient_divide_factor take
# None for the core's 0, "off").
_ZERO_DEFAULTS: dict[str, Any] = _C.zero_option_defaults()
_NONE_MEANS_ZERO = ("max_norm", "gradient_divide_factor")


def _scalar_zero_options(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The core's scalar options from ZeroOptimizer's keyword arguments, in
    the core's types."""
    out = {}
    for name, default in _ZERO_DEFAULTS.items():
        value = arguments[name]
        if value is None and name in _NONE_MEANS_ZERO:
            value = 0
        out[name] = type(default)(value)
    return out


# Hyper-parameters each inner optimizer accepts, with torch.optim's defaults:
# the core's (default_inner_options in inner_optimizer.h), stated once there.
_DEFAULTS: dict[str, dict[str, Any]] = _C.inner_optimizer_defaults()


_SCALAR_OPTIONS_MARK = "        <the scalar ZeRO options: _document_scalar_options fills them in>\n"


def _document_scalar_options(cls: type) -> type:
    """Writes the scalar ZeRO options' entries into the class docstring from the
    core's one list of them ([Note: one list of the scalar options]), so the
    C++ options, the config reader and this docstring describe them alike."""
    if cls.__doc__ is None:  # python -OO strips docstrings
        return cls
    entries = []
    for name, doc in _C.zero_option_docs().items():
        entries += textwrap.wrap(
            f"{name}: {doc}.",
            width=80,
            initial_indent=" " * 8,
            subsequent_indent=" " * 12,
            break_on_hyphens=False,
        )
    assert cls.__doc__ is not None and _SCALAR_OPTIONS_MARK in cls.__doc__
    cls.__doc__ = cls.__doc__.replace(_SCALAR_OPTIONS_MARK, "\n".join(entries) + "\n")
    return cls


def _unknown_keywords_message(
    unknown: list[str],
    kind: str,
    init: Callable[..., Any],
    accepted: Mapping[str, Any] | None = None,
) -> str:
    """What a misspelled keyword gets: the closest ZeRO option or hyper-parameter
    and both lists (a misspelled ZeRO option would otherwise read as an unknown
    hyper-parameter of the inner optimizer). ``init``: ZeroOptimizer's
    ``__init__``, whose keywords are the ZeRO options."""
    zero_options = sorted(
        name
        for name, parameter in inspect.signature(init).parameters.items()
        if name not in ("self", "params") and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    )
    hyperparameters = sorted(_DEFAULTS[kind] if accepted is None else accepted)
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, zero_options + hyperparameters, n=1)
        if close:
            hints.append(f"{name!r}: did you mean {close[0]!r}?")
    return (
        f"unexpected keyword argument(s) {unknown} for ZeroOptimizer with optimizer {kind!r}"
        + (f" ({'; '.join(hints)})" if hints else "")
        + f"; the optimizer's hyper-parameters are {hyperparameters}"
        + f"; ZeroOptimizer's own options are {zero_options}"
    )


def _plain(value: Any) -> Any:
    """Turns tensors (torch allows a Tensor lr) into Python numbers for C++."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple | list):
        return tuple(_plain(v) for v in value)
    return value


_optimizers_per_group: dict[str, int] = {}
_optimizers_built = itertools.count()  # names each optimizer's checkpoint keys


def _failure_prefix(group: dist.ProcessGroup) -> str:
    """Store keys of one optimizer: equal on every rank that builds the same ones."""
    name = getattr(group, "group_name", "") or "group"
    count = _optimizers_per_group.get(name, 0)
    _optimizers_per_group[name] = count + 1
    return f"zeroshard/{name}/optimizer{count}"


def _checkpoint_prefix() -> str:
    """Store keys of one optimizer's saves, equal on every rank of its checkpoints.

    Counted per process, not per group: a checkpoint's tensor-parallel ranks
    and replicas each build their optimizers in the same order.
    """
    return f"zeroshard/checkpoints/optimizer{next(_optimizers_built)}"


def _group_param_names(groups: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]] | None:
    """The names torch.optim kept from ``(name, parameter)`` input
    (``model.named_parameters()``) in each group's ``"param_names"``; None
    when the parameters came unnamed (torch.optim refuses a mix)."""
    if not groups or "param_names" not in groups[0]:
        return None
    named = [
        (name, p)
        for group in groups
        for name, p in zip(group["param_names"], group["params"], strict=True)
    ]
    names = [name for name, _ in named]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"parameter name(s) {repeated[:5]} given to more than one parameter; "
            "checkpoints store states by name: give each parameter its own name"
        )
    return named
