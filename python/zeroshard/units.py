"""Stage 3 for Python models: which parameters are gathered together (the wrap
policy), the module hooks that gather and release them, and partitioned
construction of models built on the meta device.

The gather/release/prefetch logic is in the C++ core (``ParameterGatherer``);
this module only decides the units and calls into it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Unit:
    """Parameters gathered and released together around ``module``'s forward."""

    name: str
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)


def _direct_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None]


def plan_units(model: nn.Module, unit_classes: Sequence[type[nn.Module]] = ()) -> list[Unit]:
    """The units of ``model``, in ``named_modules()`` order.

    A module that is an instance of one of ``unit_classes`` (a transformer
    block, say) is one unit with every parameter under it. Every other module
    that owns parameters directly, and is not inside such a unit, is a unit of
    its direct parameters. A parameter shared by several modules (tied
    embeddings) is listed in each unit that uses it: it is stored with the
    first and gathered for all.
    """
    classes = tuple(unit_classes)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"unit_classes must be nn.Module subclasses, got {cls!r}")
    units: list[Unit] = []
    covered: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in covered:
            continue
        label = name or "<root>"
        if classes and isinstance(module, classes):
            params = list(dict.fromkeys(module.parameters()))  # dedupe, keep order
            for sub in module.modules():
                covered.add(id(sub))
            if params:
                units.append(Unit(label, module, params))
            continue
        direct = _direct_params(module)
        if direct:
            units.append(Unit(label, module, direct))
    return units


def register_hooks(impl: object, units: list[Unit]) -> list[torch.utils.hooks.RemovableHandle]:
    """Registers each unit's pre/post-forward hooks (implemented in C++)."""
    from zeroshard import _C

    handles: list[torch.utils.hooks.RemovableHandle] = []
    for index, unit in enumerate(units):
        handles.extend(_C.register_unit_hooks(impl, unit.module, index))
    return handles


def _apply_order(module: nn.Module) -> Iterator[nn.Module]:
    """Modules in the order ``module.apply(fn)`` visits them (children first)."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


def _default_init(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise ValueError(
            f"partitioned construction: module {type(module).__name__} owns parameters but has "
            "no reset_parameters(); pass param_init_fn=... that initializes a module's "
            "direct parameters in place"
        )
    reset()


def materialize(
    impl: object,
    model: nn.Module,
    param_groups: list[dict],
    param_init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Replaces meta parameters by sharded real ones and initializes them.

    Each module is initialized in ``Module.apply`` order with its storage
    gathered (or zero-allocated) just for that module, so a rank never holds
    more than its shards plus one module's parameters. With the same RNG state
    on every rank the values equal those of a full construction followed by
    ``model.apply(param_init_fn)``.
    """
    replacements = impl.replacement_parameters()  # type: ignore[attr-defined]
    swap: dict[int, nn.Parameter] = {}
    for group, group_replacements in zip(param_groups, replacements, strict=True):
        new_params = []
        for old, replacement in zip(group["params"], group_replacements, strict=True):
            new = nn.Parameter(replacement, requires_grad=old.requires_grad)
            swap[id(old)] = new
            new_params.append(new)
        group["params"] = new_params
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in swap:
                module._parameters[name] = swap[id(param)]
            elif param is not None and param.is_meta:
                raise ValueError(
                    f"parameter {name!r} of {type(module).__name__} is on the meta device but "
                    "not in the optimizer; pass all of the model's parameters"
                )
    impl.adopt_parameters([group["params"] for group in param_groups])  # type: ignore[attr-defined]
    init = param_init_fn or _default_init
    with torch.no_grad():
        for module in _apply_order(model):
            direct = _direct_params(module)
            if not direct:
                continue
            impl.begin_initialization(direct)  # type: ignore[attr-defined]
            try:
                init(module)
            finally:
                impl.end_initialization(direct)  # type: ignore[attr-defined]
