"""Composition with PyTorch tensor parallelism: models whose parameters are DTensors.

``torch.distributed.tensor.parallel.parallelize_module`` turns a module's
parameters into DTensors: each rank holds a local piece (``Shard``) or a
copy (``Replicate``) of every tensor, over the tensor-parallel mesh. ZeRO
works on the local tensors: they are what zeroshard flattens, shards over the
data-parallel group, gathers and updates, in place, so the DTensors keep
seeing their values. Two things cross the tensor-parallel group (in the C++
core, ``set_tensor_parallel``): the global gradient norm and the decision to
skip a non-finite step.

Autograd puts a DTensor parameter's gradient on the DTensor, not on its
local tensor, so a post-accumulate hook per DTensor parameter hands the local
gradient to zeroshard, as the C++ core's own hooks do for plain parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.host_channel import add_host_backend

__all__ = ["TensorParallelParameters"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed tensors
        return None
    return DTensor


def _split_of(param: torch.Tensor) -> tuple[int, int, list[int]] | None:
    """Where ``param``'s local piece sits in the unsplit tensor: (dim, start, shape).

    What the C++ core's checkpoints need (``TensorParallelSplit``); dim -1
    for a plain tensor or a ``Replicate`` copy; None for a placement
    checkpoints cannot describe (e.g. ``_StridedShard``), which still trains.
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        return (-1, 0, list(param.shape))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shards = [pl for pl in param.placements if pl.is_shard()]
    if not shards:
        return (-1, 0, list(param.shape))
    if len(shards) > 1 or type(shards[0]).__name__ != "Shard":
        return None
    dim = shards[0].dim % param.ndim
    _, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return (dim, int(offset[dim]), list(param.shape))


class TensorParallelParameters:
    """The local tensors zeroshard uses in place of a model's DTensor parameters."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        dtensor = _dtensor_type()
        self._local: dict[int, torch.Tensor] = {}
        self._entries: list[tuple[int, int, torch.Tensor]] = []
        meshes = []
        for g, group in enumerate(param_groups):
            for i, param in enumerate(group["params"]):
                if dtensor is None or not isinstance(param, dtensor):
                    continue
                local = param._local_tensor
                if local.is_meta:
                    raise ValueError(
                        f"parameter {i} of group {g} is a DTensor on the meta device; "
                        "materialize tensor-parallel models before building the optimizer"
                    )
                # The C++ core waits only for parameters that require grad.
                local.requires_grad_(param.requires_grad)
                self._local[id(param)] = local
                self._entries.append((g, i, param))
                # Slicing a mesh (mesh["tp"]) makes a new object each time.
                if all(param.device_mesh != m for m in meshes):
                    meshes.append(param.device_mesh)
        if len(meshes) > 1 or (meshes and meshes[0].ndim != 1):
            shapes = [tuple(m.mesh_dim_names or m.shape) for m in meshes]
            raise ValueError(
                f"tensor-parallel parameters must all live on one 1-D tensor-parallel mesh; "
                f"found {shapes}. Parallelize the model over mesh['tp'] and give zeroshard "
                "the data-parallel mesh (device_mesh=mesh['dp'])"
            )
        self.mesh = meshes[0] if meshes else None
        self.sharded = [
            [
                id(p) in self._local and any(pl.is_shard() for pl in p.placements)
                for p in group["params"]
            ]
            for group in param_groups
        ]
        splits = [[_split_of(p) for p in group["params"]] for group in param_groups]
        self._unsplittable = [
            f"parameter {i} of group {g} ({param_groups[g]['params'][i].placements})"
            for g, group in enumerate(splits)
            for i, split in enumerate(group)
            if split is None
        ]
        # The core refuses checkpoints without splits; check_checkpointable
        # says why first.
        self.splits = [] if self._unsplittable else splits

    def check_checkpointable(self) -> None:
        """Raises (on every rank alike) when a placement has no checkpoint layout."""
        if self._unsplittable:
            raise NotImplementedError(
                "checkpoints of tensor-parallel parameters placed other than Shard(dim) or "
                f"Replicate are not supported: {self._unsplittable[:3]}; save "
                "full_state_dict() instead"
            )

    @property
    def active(self) -> bool:
        """Whether any parameter is a DTensor."""
        return self.mesh is not None

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """What zeroshard shards for ``param``: its local tensor, or itself."""
        return self._local.get(id(param), param)

    def locals(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        return [self.local(p) for p in params]

    def attach(self, optimizer: Any, impl: Any, stage: int) -> list[Any]:
        """Tells the core about the split and hooks the DTensor parameters' gradients.

        At stage 1 the local gradient stays an alias of the DTensor's ``.grad``
        (stage 1 keeps ``.grad``); at stages 2 and 3 it moves to the local
        tensor and the DTensor's ``.grad`` is released, as zeroshard releases
        plain parameters' gradients.
        """
        if not self.active:
            return []
        group = self.mesh.get_group()
        add_host_backend(group)  # see zeroshard.host_channel
        impl.set_tensor_parallel(group, self.sharded, self.splits)
        # A weak reference: a hook holding the optimizer would keep it (and
        # its process groups) alive as long as the model.
        owner = weakref.ref(optimizer)
        handles = []
        for g, i, param in self._entries:
            local = self._local[id(param)]

            def hook(p: torch.Tensor, g: int = g, i: int = i, local: torch.Tensor = local) -> None:
                optimizer = owner()
                if optimizer is None or p.grad is None:
                    return
                grad = p.grad
                if grad.placements != p.placements:
                    # e.g. a Partial gradient of a replicated norm weight under
                    # sequence parallelism: this rank holds a partial sum.
                    grad = grad.redistribute(placements=p.placements)
                piece = grad._local_tensor
                if hasattr(piece, "wait"):  # an AsyncCollectiveTensor
                    piece = piece.wait()
                if stage == 1:
                    local.grad = piece
                else:
                    # Under no_sync the core leaves gradients in .grad: add up.
                    local.grad = piece if local.grad is None else local.grad.add_(piece)
                    p.grad = None
                optimizer._impl.gradient_arrived(g, i)

            handles.append(param.register_post_accumulate_grad_hook(hook))
        return handles

    def scale_local_gradients(self, factor: float) -> None:
        """Divides the local gradients the hooks moved off the DTensors (see pipelining)."""
        for _, _, param in self._entries:
            local = self._local[id(param)]
            if param.grad is None and local.grad is not None:
                local.grad.div_(factor)

    def full_tensors(self, values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Collective over the tensor-parallel group: full tensors from local pieces.

        ``values`` maps ``id(param)`` to that parameter's local values (as the
        core's ``full_parameters`` returns them).
        """
        from torch.distributed.tensor import DTensor

        out = dict(values)
        for _, _, param in self._entries:
            if id(param) in out:
                piece = out[id(param)]
                out[id(param)] = DTensor.from_local(
                    piece,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,  # uneven splits
                    stride=param.stride(),
                ).full_tensor()
        return out
