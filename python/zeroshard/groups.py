"""Where the data-parallel groups come from.

A ZeroOptimizer shards over one process group and, with hybrid sharding
(FSDP2's HSDP), replicates over a second one. Users name them in the ways
PyTorch and DeepSpeed users already do: a process group, a ``DeviceMesh``
(1-D, or 2-D ``("replicate", "shard")``), DeepSpeed's ``mpu`` object, or the
config's ``zero_hpz_partition_size``. This module turns each into the pair.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["DataParallelGroups", "data_parallel_groups", "hybrid_groups", "store_of"]


class DataParallelGroups:
    """The shard group and, with hybrid sharding, the replicate group."""

    def __init__(self, shard: dist.ProcessGroup, replicate: dist.ProcessGroup | None) -> None:
        self.shard = shard
        self.replicate = replicate if replicate is not None and _size(replicate) > 1 else None

    @property
    def world_size(self) -> int:
        """Data-parallel ranks whose gradients are averaged: shard size x replicas."""
        return _size(self.shard) * (_size(self.replicate) if self.replicate is not None else 1)


def store_of(group: dist.ProcessGroup) -> dist.Store | None:
    """The store ``group`` was created with (torch keeps it in a private map)."""
    try:
        return dist.distributed_c10d._world.pg_map[group][1]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _default_group() -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "zeroshard needs a process group: call torch.distributed.init_process_group() "
            "first (torchrun sets up the environment for it) or pass process_group= or "
            "device_mesh="
        )
    return dist.group.WORLD


def _mesh_groups(mesh: Any) -> DataParallelGroups:
    """A 1-D mesh is the shard group; a 2-D one is (replicate, shard) as FSDP2's HSDP."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        return DataParallelGroups(mesh.get_group(), None)
    if mesh.ndim != 2:
        raise ValueError(
            f"device_mesh must be 1-D (shard over it) or 2-D (replicate, shard); got "
            f"{mesh.ndim} dimensions {names or ''}: pass the data-parallel sub-mesh, e.g. "
            'mesh["dp"] or mesh["dp_replicate", "dp_shard"]'
        )
    if names:
        replicate = [n for n in names if n.endswith("replicate")]
        shard = [n for n in names if n.endswith("shard")]
        if len(replicate) != 1 or len(shard) != 1:
            raise ValueError(
                f"a 2-D device_mesh is read as (replicate, shard) for hybrid sharding; its "
                f"dimensions are named {names}. Name them e.g. ('replicate', 'shard') or "
                "('dp_replicate', 'dp_shard'), or pass a 1-D data-parallel sub-mesh such as "
                'mesh["dp"] (a "tp" or "pp" dimension is not data parallel)'
            )
        return DataParallelGroups(mesh.get_group(shard[0]), mesh.get_group(replicate[0]))
    return DataParallelGroups(mesh.get_group(1), mesh.get_group(0))


def hybrid_groups(
    shard_group_size: int, group: dist.ProcessGroup | None = None
) -> DataParallelGroups:
    """Collective: shard groups of ``shard_group_size`` consecutive ranks of ``group``.

    Ranks ``k * shard_group_size ... (k + 1) * shard_group_size - 1`` shard
    the state together (torchrun numbers the ranks of a node together, so
    with the node's size the parameter all-gathers stay inside the node);
    the ranks with the same position in each shard group replicate it. As
    the C++ ``make_hybrid_gloo_groups``.
    """
    group = group or _default_group()
    ranks = dist.get_process_group_ranks(group)
    world = len(ranks)
    if shard_group_size < 1 or world % shard_group_size != 0:
        raise ValueError(
            f"hybrid sharding needs a shard group size that divides the world size {world}; "
            f"got {shard_group_size}"
        )
    if shard_group_size == world:
        return DataParallelGroups(group, None)
    if dist.get_world_size() != world:
        # new_subgroups_by_enumeration is collective over every rank of the
        # job; data-parallel groups of a TP/PP mesh would each enumerate
        # other ranks under the same group names and meet the wrong peers.
        raise ValueError(
            "zero_hpz_partition_size (hybrid_groups) splits the whole job; this data-parallel "
            f"group has {world} of {dist.get_world_size()} ranks. Pass a 2-D (replicate, shard) "
            "device mesh instead, e.g. mesh['dp_replicate', 'dp_shard']"
        )
    shards = [ranks[i : i + shard_group_size] for i in range(0, world, shard_group_size)]
    replicas = [ranks[j::shard_group_size] for j in range(shard_group_size)]
    shard, _ = dist.new_subgroups_by_enumeration(shards)
    replicate, _ = dist.new_subgroups_by_enumeration(replicas)
    return DataParallelGroups(shard, replicate)


def data_parallel_groups(
    process_group: dist.ProcessGroup | None = None,
    device_mesh: Any = None,
    replicate_group: dist.ProcessGroup | None = None,
    mpu: Any = None,
) -> DataParallelGroups:
    """The groups named by whichever one argument is given (the default group if none).

    ``mpu`` is DeepSpeed's model-parallel unit: its
    ``get_data_parallel_group()`` is the shard group.
    """
    given = [
        name
        for name, value in (
            ("process_group", process_group),
            ("device_mesh", device_mesh),
            ("mpu", mpu),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"pass one of process_group=, device_mesh= and mpu=, not {given}")
    if device_mesh is not None:
        if replicate_group is not None:
            raise ValueError(
                "replicate_group= goes with process_group=; a device_mesh names both groups "
                "itself (2-D: replicate, shard)"
            )
        return _mesh_groups(device_mesh)
    if mpu is not None:
        process_group = mpu.get_data_parallel_group()
    if replicate_group is not None and process_group is None:
        raise ValueError(
            "replicate_group= needs process_group= (this rank's shard group); with the "
            "default group as the shard group every rank would be a replica of itself"
        )
    return DataParallelGroups(process_group or _default_group(), replicate_group)
