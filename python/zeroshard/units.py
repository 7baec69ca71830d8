"""Stage 3 for Python models: which parameters are gathered together (the wrap
policy), the module hooks that gather and release them, and partitioned
construction of models built on the meta device.

The gather/release/prefetch logic is in the C++ core (``ParameterGatherer``);
this module only decides the units and calls into it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

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


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


# Mixture-of-experts blocks of common libraries (transformers' MixtralSparseMoeBlock,
# Qwen2MoeSparseMoeBlock, DeepseekV3MoE, DeepSpeed's MoE, ...), by class name.
_MOE_BLOCK = re.compile(r"mo[e](block|layer)?$", re.IGNORECASE)


def is_moe_block(module: nn.Module) -> bool:
    """Whether ``module``'s class looks like a mixture-of-experts block."""
    return bool(_MOE_BLOCK.search(type(module).__name__))


# Set by set_leaf_modules on the instances it marks.
_LEAF_ATTRIBUTE = "_zeroshard_leaf"


def set_leaf_modules(
    model: nn.Module, leaf_classes: Sequence[type[nn.Module] | str]
) -> list[nn.Module]:
    """Marks every module of ``model`` whose class is in ``leaf_classes`` (classes or
    class names) as a stage 3 leaf: one unit with every parameter under it,
    gathered when its forward starts, whatever the unit policy (DeepSpeed's
    ``set_z3_leaf_modules``). Call it before building the optimizer.

    Stage 3 trains correctly without it when ranks run different submodules
    (a mixture of experts routing by data): the ranks agree on each gather.
    A leaf is a performance choice: one gather for the whole block instead of
    one per expert, and no rank waits for the others' choices inside it.
    Returns the marked modules; a class no module of ``model`` has is an
    error listing the classes it does have.
    """
    names = [c for c in leaf_classes if isinstance(c, str)]
    classes = [c for c in leaf_classes if not isinstance(c, str)]
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"leaf_classes must be nn.Module subclasses or names, got {cls!r}")
    wanted = tuple(classes) + resolve_unit_classes(model, names)
    marked = [m for m in model.modules() if isinstance(m, wanted)]
    if not marked:
        short = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"zeroshard.set_leaf_modules: no module of the model is a "
            f"{[c.__name__ for c in wanted]}; its module classes are {short}"
        )
    for module in marked:
        setattr(module, _LEAF_ATTRIBUTE, True)
    return marked


def is_leaf_module(module: nn.Module) -> bool:
    """Whether :func:`set_leaf_modules` marked ``module``."""
    return bool(getattr(module, _LEAF_ATTRIBUTE, False))


def repeated_blocks(model: nn.Module) -> set[int]:
    """ids of the default policy's blocks: mixture-of-experts blocks (see
    :func:`is_moe_block`), the children of an ``nn.ModuleList``, and the
    children of an ``nn.Sequential`` whose class repeats there (the layers of
    a transformer), that hold parameters. Outermost only: a list inside a
    block belongs to the block. A MoE block is one unit with all its experts
    (DeepSpeed's ``set_z3_leaf_modules``), and so is a module marked by
    :func:`set_leaf_modules`: one gather for the block. Experts that are
    units of their own train too (the ranks agree on each gather), at the
    cost of one agreement per expert.
    """
    # An explicit stack, not a recursive closure: a nested function that
    # calls itself is a reference cycle that would hold the model until the
    # garbage collector runs (see _UnitIds).
    blocks: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if module is not model and is_leaf_module(module) and _has_params(module):
            blocks.add(id(module))
            continue
        if module is not model and is_moe_block(module) and _has_params(module):
            blocks.add(id(module))
            continue
        children = list(module.children())
        if isinstance(module, nn.ModuleList):
            found = [c for c in children if _has_params(c)]
        elif isinstance(module, nn.Sequential):
            counts: dict[type, int] = {}
            for child in children:
                counts[type(child)] = counts.get(type(child), 0) + 1
            found = [c for c in children if counts[type(c)] > 1 and _has_params(c)]
        else:
            found = []
        blocks.update(id(c) for c in found)
        stack.extend(c for c in reversed(children) if id(c) not in blocks)
    return blocks


def resolve_unit_classes(model: nn.Module, names: Sequence[str]) -> tuple[type[nn.Module], ...]:
    """The module classes of ``model`` that ``names`` designate, by class name
    (``"LlamaDecoderLayer"``) or qualified name (``"transformers.models.llama.
    modeling_llama.LlamaDecoderLayer"``); a name no module of the model has is
    an error listing the classes it does have."""
    present: dict[str, type[nn.Module]] = {}
    for module in model.modules():
        cls = type(module)
        present.setdefault(cls.__name__, cls)
        present.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    missing = [name for name in names if name not in present]
    if missing:
        short = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"zeroshard.unit_classes names {missing}, which no module of the model is; "
            f"its module classes are {short}"
        )
    return tuple(dict.fromkeys(present[name] for name in names))


def plan_units(
    model: nn.Module,
    unit_classes: Sequence[type[nn.Module]] = (),
    owned: set[int] | None = None,
) -> list[Unit]:
    """The units of ``model`` (the stage 3 wrap policy), in ``named_modules()`` order.

    Blocks are the instances of ``unit_classes`` or, when none are given, the
    repeated layers (see :func:`repeated_blocks`). A block is one unit with
    every parameter under it; blocks do not nest. Every other module that owns
    parameters directly and is not inside a unit is a unit with its own
    parameters and those of its descendants outside blocks: a module's forward
    may read a child's parameters without calling the child
    (``nn.MultiheadAttention`` reads ``out_proj.weight``), so they must be
    gathered while the module runs. A parameter shared by several units (tied
    embeddings) is listed in each: it is stored with the first and gathered
    for all.

    With ``owned`` (ids), units list only those parameters: the plan of one of
    two optimizers sharing a model (dense and experts); a unit left with none
    is dropped, so each optimizer gathers what it holds at the same modules.
    """
    classes = tuple(unit_classes)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"unit_classes must be nn.Module subclasses, got {cls!r}")
    blocks = set() if classes else repeated_blocks(model)
    units: list[Unit] = []
    visited: set[int] = set()
    # Pre-order over (name, module, the unit it belongs to, inside a block?),
    # with an explicit stack for the reason given in repeated_blocks.
    stack: list[tuple[str, nn.Module, Unit | None, bool]] = [("", model, None, False)]
    while stack:
        name, module, owner, in_block = stack.pop()
        if id(module) in visited:  # a module registered twice is visited once, as named_modules
            continue
        visited.add(id(module))
        is_block = is_leaf_module(module) or (
            isinstance(module, classes) if classes else id(module) in blocks
        )
        if is_block and not in_block:
            owner, in_block = Unit(name or "<root>", module), True
            units.append(owner)
        elif owner is None and _direct_params(module):
            owner = Unit(name or "<root>", module)
            units.append(owner)
        if owner is not None:
            owner.params.extend(_direct_params(module))
        stack.extend(
            (f"{name}.{child_name}" if name else child_name, child, owner, in_block)
            for child_name, child in reversed(list(module.named_children()))
        )
    for unit in units:
        kept = (p for p in unit.params if owned is None or id(p) in owned)
        unit.params = list(dict.fromkeys(kept))  # dedupe, keep order
    return [unit for unit in units if unit.params]


def register_hooks(
    impl: object, units: list[Unit], model: nn.Module | None = None
) -> list[torch.utils.hooks.RemovableHandle]:
    """Registers each unit's pre/post-forward hooks (implemented in C++), and on
    ``model`` a hook that explains a read of a released parameter."""
    from zeroshard import _C

    handles: list[torch.utils.hooks.RemovableHandle] = []
    for index, unit in enumerate(units):
        handles.extend(_C.register_unit_hooks(impl, unit.module, index))
    if model is not None:
        # After the units' hooks: the model's own post-forward hook (the
        # ranks' agreement that every forward returned) runs after its unit
        # released its parameters.
        handles.extend(_C.register_model_forward_hooks(impl, model))
        handles.append(_register_released_read_note(model, units))
    return handles


# What an op that touches a released parameter raises: ShardedParameter's
# refusal ([Note: a released parameter refuses reads]), or ATen's own checks
# for tensors that are not ShardedParameters (see [Note: Released parameters]
# in parameter_gatherer.h).
_RELEASED_READ_MESSAGES = (
    "released between gathers",
    "storage of size 0",
    "data is not allocated",
)


@dataclass(frozen=True)
class _UnitIds:
    """What the released-read note needs of a unit, by id only: a hook that
    held the modules would make a reference cycle through the model, which
    would keep the optimizer (and its process group) alive past
    ``destroy_process_group()`` until the interpreter's final collection."""

    name: str
    module: int
    params: frozenset[int]


def _register_released_read_note(
    model: nn.Module, units: list[Unit]
) -> torch.utils.hooks.RemovableHandle:
    """A forward hook on the model that runs when its forward raised: if an op
    read a released parameter, the exception gets a note that names the
    parameters and the module to make a unit (torch re-raises the original
    exception after always_call hooks, so a note is what a hook can add)."""
    ids = [_UnitIds(u.name, id(u.module), frozenset(id(p) for p in u.params)) for u in units]

    def note(module: nn.Module, args: Any, output: Any) -> None:
        if output is not None:  # the forward returned: nothing to explain
            return
        error = sys.exc_info()[1]
        if error is None or not any(m in str(error) for m in _RELEASED_READ_MESSAGES):
            return
        text = explain_released_read(module, ids, error.__traceback__)
        if text and text not in getattr(error, "__notes__", ()):
            error.add_note(text)

    return model.register_forward_hook(note, always_call=True)


def explain_released_read(
    model: nn.Module, units: list[_UnitIds], traceback: TracebackType | None
) -> str | None:
    """Which module's forward read parameters its units do not gather.

    The innermost module of ``model`` on the traceback is the one whose forward
    made the failing op; the parameters under it that no enclosing unit lists
    are those it read without calling their own module.
    """
    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    culprit_module = None
    for frame in reversed(frames):  # innermost first
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, nn.Module) and id(candidate) in names:
            culprit_module = candidate
            break
    del frames
    if culprit_module is None:
        return None
    prefix = names[id(culprit_module)]
    ancestors = _ancestors(model, culprit_module)
    gathered = {p for unit in units if unit.module in ancestors for p in unit.params}
    owner = {p: unit.name for unit in units for p in unit.params}
    released = [
        (f"{prefix}.{name}" if prefix != "<root>" else name, owner.get(id(p), "none"))
        for name, p in culprit_module.named_parameters()
        if id(p) not in gathered
    ]
    if not released:
        return None
    listed = ", ".join(f"'{name}' (unit '{unit}')" for name, unit in released[:5])
    more = f" and {len(released) - 5} more" if len(released) > 5 else ""
    cls = type(culprit_module).__name__
    return (
        f"zeroshard stage 3: the forward of '{prefix}' ({cls}) read parameters that no unit "
        f"enclosing it gathers, so they were released: {listed}{more}. Make '{prefix}' one "
        f"unit: pass unit_classes=({cls}, ...) to ZeroOptimizer or zeroshard.initialize, or "
        f'list "{cls}" in the config\'s "zeroshard": {{"unit_classes": [...]}}.'
    )


def _ancestors(model: nn.Module, target: nn.Module) -> set[int]:
    """ids of ``target`` and the modules above it in ``model``."""
    for name, module in model.named_modules():
        if module is target:
            chain = {id(model), id(target)}
            current = model
            for part in name.split(".") if name else []:
                current = getattr(current, part)
                chain.add(id(current))
            return chain
    return {id(target)}


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
    # An initializer that fails on some ranks only (a bad shape on one rank,
    # an RNG-dependent check) must not leave the others to train or to wait:
    # the failed rank stops initializing but keeps the per-module collectives
    # going, and finish_initialization raises on every rank.
    failure = ""
    original: BaseException | None = None
    with torch.no_grad():
        for module in _apply_order(model):
            direct = _direct_params(module)
            if not direct:
                continue
            impl.begin_initialization(direct)  # type: ignore[attr-defined]
            try:
                if not failure:
                    init(module)
            except Exception as error:  # noqa: BLE001 - agreed across ranks below
                failure = f"in {type(module).__name__}: {type(error).__name__}: {error}"
                original = error
            finally:
                impl.end_initialization(direct)  # type: ignore[attr-defined]
    try:
        impl.finish_initialization(failure)  # type: ignore[attr-defined]
    except ValueError as agreed:
        raise agreed from original
