"""Stage 3's parameters: full shape always, values only while gathered.

[Note: a released parameter refuses reads]
At stage 3 each parameter is a view of its bucket's gathered buffer, whose
storage holds no memory while the bucket is released (see [Note: Released
parameters] in parameter_gatherer.h). Some ATen kernels check for that
("data is not allocated yet"); others compute ``nullptr + offset`` and read
it, which is a SIGSEGV: ``p.clone()``, ``model.state_dict()`` values,
``copy.deepcopy(model)``, a DDP wrap. So the optimizer turns each stage-3
parameter into a ``ShardedParameter`` (the ``__class__`` swap torch's lazy
modules use), whose ``__torch_function__`` lets metadata through (shape,
dtype, device, ``.grad``, hooks), answers conversions that change nothing
(``model.to("cpu:0")``, ``.float()`` of fp32) with the parameter itself, and
refuses any other op on a released parameter with an error naming it and the
ways to full values. A gathered parameter (inside a unit's forward, inside
``gathered_parameters()``, a persistent one) behaves as ``nn.Parameter``.

FSDP2 shows a sharded DTensor instead; we keep the full shape, as
``p.shape`` and ``p.numel()`` are what users and libraries size things by
(DeepSpeed's empty ``data`` with ``ds_shape`` breaks exactly those).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

# Ops that read metadata only: allowed on a released parameter.
_METADATA: frozenset[Any] = frozenset(
    [
        getattr(torch.Tensor, name).__get__
        for name in (
            "shape",
            "dtype",
            "device",
            "requires_grad",
            "is_leaf",
            "grad",
            "grad_fn",
            "ndim",
            "layout",
            "is_cuda",
            "is_cpu",
            "is_meta",
            "is_sparse",
            "is_quantized",
            "is_nested",
            "is_mkldnn",
            "is_xpu",
            "is_mps",
            "names",
            "name",
            "_version",
            "_base",
            "output_nr",
            "itemsize",
            "nbytes",
        )
        if hasattr(torch.Tensor, name)
    ]
    + [
        getattr(torch.Tensor, name).__set__
        for name in ("grad", "requires_grad", "data")
        if hasattr(torch.Tensor, name)
    ]
    + [
        getattr(torch.Tensor, name)
        for name in (
            "size",
            "dim",
            "numel",
            "nelement",
            "stride",
            "storage_offset",
            "is_contiguous",
            "is_floating_point",
            "is_complex",
            "is_signed",
            "element_size",
            "get_device",
            "requires_grad_",
            "register_hook",
            "register_post_accumulate_grad_hook",
            "untyped_storage",
            "is_shared",
            "is_pinned",
            "_is_view",
            "__len__",
            "__dir__",
            "__hash__",
            "__format__",
        )
        if hasattr(torch.Tensor, name)
    ]
    + [torch._has_compatible_shallow_copy_type]
)


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cpu" and "cpu:0" are one device; a CUDA device without an index is
    # the current one.
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index is None or b.index is None:
        return True
    return a.index == b.index


def _dtype_only(dtype: torch.dtype) -> Callable[[torch.Tensor, tuple[Any, ...], dict], bool]:
    return lambda p, args, kwargs: p.dtype == dtype


def _to_unchanged(p: torch.Tensor, args: tuple[Any, ...], kwargs: dict) -> bool:
    if kwargs.get("copy", False):
        return False
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return (
        (device is None or _same_device(torch.device(device), p.device))
        and (dtype is None or dtype == p.dtype)
        and memory_format in (None, torch.preserve_format)
    )


def _cuda_unchanged(p: torch.Tensor, args: tuple[Any, ...], kwargs: dict) -> bool:
    device = args[0] if args else kwargs.get("device")
    if device is None:
        return p.is_cuda
    if isinstance(device, int):
        device = torch.device("cuda", device)
    return _same_device(torch.device(device), p.device)


# Conversions that return the parameter itself where they change nothing
# (Module.to/.cuda/.cpu/.float call these on every parameter).
_CONVERSIONS: dict[Any, Callable[[torch.Tensor, tuple[Any, ...], dict], bool]] = {
    torch.Tensor.to: _to_unchanged,
    torch.Tensor.cpu: lambda p, args, kwargs: p.device.type == "cpu",
    torch.Tensor.cuda: _cuda_unchanged,
    torch.Tensor.float: _dtype_only(torch.float32),
    torch.Tensor.double: _dtype_only(torch.float64),
    torch.Tensor.half: _dtype_only(torch.float16),
    torch.Tensor.bfloat16: _dtype_only(torch.bfloat16),
}


def is_released(p: torch.Tensor) -> bool:
    """Whether ``p``'s storage holds no memory now (a released stage-3 bucket)."""
    with torch._C.DisableTorchFunctionSubclass():
        return p.numel() > 0 and p.untyped_storage().nbytes() == 0


def _released_in(values: Iterable[Any]) -> ShardedParameter | None:
    for value in values:
        if isinstance(value, ShardedParameter):
            if is_released(value):
                return value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, ShardedParameter) and is_released(item):
                    return item
    return None


def released_read_error(p: torch.Tensor, what: str) -> RuntimeError:
    """The error for reading the values of a released stage-3 parameter."""
    name = getattr(p, "_zeroshard_name", None) or "a stage-3 parameter"
    return RuntimeError(
        f"zeroshard: {what} cannot read parameter '{name}' (shape {list(p.shape)}, "
        f"{p.dtype}): at stage 3 it is partitioned across the ranks and released between "
        "gathers, so this rank holds only its shard. For full values, read it inside "
        "`with optimizer.gathered_parameters():` (collective: every rank enters it); to "
        "save, use optimizer.full_state_dict() or optimizer.save_checkpoint(); to move or "
        "convert the model, do it before building the ZeroOptimizer. Do not wrap a stage-3 "
        "model in DistributedDataParallel: zeroshard reduces the gradients itself "
        "(see zeroshard.integrations for Trainer and Accelerate)."
    )


def _describe(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    name = name.replace("TensorBase.", "Tensor.")
    if name in ("detach", "Tensor.detach"):
        return "Tensor.detach (used by module.state_dict(), DistributedDataParallel and copies)"
    return name if name.startswith("Tensor.") or "." in name else f"torch.{name}"


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter (see [Note: a released parameter refuses reads])."""

    _zeroshard_name: str

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        with torch._C.DisableTorchFunctionSubclass():
            if func not in _METADATA:
                # A conversion that changes nothing returns the parameter
                # itself, gathered or not: a copy would leave the optimizer's
                # storage (see [Note: parameters that left the optimizer's
                # storage] in zero_optimizer_attachment.cpp).
                unchanged = _CONVERSIONS.get(func)
                if (
                    unchanged is not None
                    and args
                    and isinstance(args[0], ShardedParameter)
                    and unchanged(args[0], args[1:], kwargs)
                ):
                    return args[0]
                released = _released_in(args)
                if released is None and kwargs:
                    released = _released_in(kwargs.values())
                if released is not None:
                    raise released_read_error(released, _describe(func))
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        if id(self) in memo:
            return memo[id(self)]
        if is_released(self):
            raise released_read_error(self, "copy.deepcopy")
        # The copy is the user's own tensor: a plain Parameter no optimizer holds.
        with torch._C.DisableTorchFunctionSubclass():
            result = nn.Parameter(self.data.clone(), self.requires_grad)
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, protocol: Any) -> Any:
        if is_released(self):
            raise released_read_error(self, "pickling (torch.save of a module)")
        with torch._C.DisableTorchFunctionSubclass():
            data = self.data
        return (torch._utils._rebuild_parameter, (data, self.requires_grad, {}))

    def __repr__(self) -> str:
        if is_released(self):
            name = getattr(self, "_zeroshard_name", "")
            return (
                f"ShardedParameter({name!r}, shape={list(self.shape)}, dtype={self.dtype}, "
                "released: gather with optimizer.gathered_parameters() to read it)"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return "Parameter containing:\n" + torch.Tensor.__repr__(self)


def adopt_sharded_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Makes each plain ``nn.Parameter`` of ``named`` a ``ShardedParameter``.

    Tied parameters keep their first name. DTensor and other subclasses are
    left as they are.
    """
    for name, p in named:
        if type(p) is nn.Parameter:
            p.__class__ = ShardedParameter
        if isinstance(p, ShardedParameter) and not hasattr(p, "_zeroshard_name"):
            p._zeroshard_name = name


__all__ = ["ShardedParameter", "adopt_sharded_parameters", "is_released", "released_read_error"]
