"""Keeps ``torch.distributed.destroy_process_group()`` able to free the group.

[Note: the default group pinned by default arguments]
Some ``torch.distributed`` modules give functions a default argument of
``group.WORLD`` (``torch.distributed.nn.functional``, FSDP's sharded grad
scaler, ``ZeroRedundancyOptimizer``). Python evaluates defaults once, on
import, and ``torch.optim.Optimizer.__init__`` imports ``torch._dynamo``, which
imports those modules. Imported after ``init_process_group()``, the defaults
hold the default group itself, so ``destroy_process_group()`` leaves it alive:
Gloo's worker threads then run until interpreter exit, and a worker that frees
a Python-owned tensor of a late Work while the interpreter finalizes aborts the
process ("terminate called without an active exception", about 1 run in 5 of
the main job). Imported before ``init_process_group()`` the defaults are
``None``, which those functions read as "the default group"; this module puts
``None`` back wherever a default holds a live process group.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch.distributed as dist


def _release_in_function(function: types.FunctionType) -> int:
    changed = 0
    defaults = function.__defaults__
    if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
        function.__defaults__ = tuple(
            None if isinstance(d, dist.ProcessGroup) else d for d in defaults
        )
        changed = 1
    keyword_defaults = function.__kwdefaults__
    if keyword_defaults and any(
        isinstance(d, dist.ProcessGroup) for d in keyword_defaults.values()
    ):
        function.__kwdefaults__ = {
            k: None if isinstance(d, dist.ProcessGroup) else d for k, d in keyword_defaults.items()
        }
        changed = 1
    return changed


def release_pinned_default_groups() -> int:
    """Replaces process groups held as default arguments in ``torch.distributed``.

    Returns how many functions it changed. Cheap and idempotent: zeroshard
    calls it on import and after constructing an optimizer.
    """
    if not dist.is_available():
        return 0
    changed = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            # type(), not isinstance(): some module attributes are deprecation
            # proxies that warn when their __class__ is read.
            if type(value) is types.FunctionType and value.__module__ == name:
                changed += _release_in_function(value)
            elif issubclass(type(value), type) and value.__module__ == name:
                changed += sum(_release_in_class(value))
    return changed


_METHOD_WRAPPERS = (staticmethod, classmethod)


def _release_in_class(cls: type) -> list[int]:
    out = []
    for attribute in vars(cls).values():
        function: Any = attribute.__func__ if type(attribute) in _METHOD_WRAPPERS else attribute
        if type(function) is types.FunctionType:
            out.append(_release_in_function(function))
    return out
