"""Host tensors on NCCL groups: the channel zeroshard's agreements travel over.

What ranks agree on (which units to gather, which buckets are ready, which
parameters had a gradient, error messages) is host knowledge. Over an
NCCL-only group it would have to go to the GPU and come back: two host syncs
per agreement, each queued behind the collectives in flight ([Note: the host
channel] in ``csrc/include/zeroshard/communicator.h``). So a group given to
zeroshard that has no CPU backend gets one: a Gloo backend over the same
ranks, met through the group's own store, registered for CPU tensors. That is
the group ``init_process_group("cpu:gloo,cuda:nccl")`` would have built; GPU
tensors still go to NCCL.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from zeroshard.groups import store_of

__all__ = ["add_host_backend", "has_host_backend"]

_channels_made: dict[str, int] = {}  # per group name


def has_host_backend(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` takes CPU tensors (Gloo, or a CPU backend beside NCCL)."""
    return torch.device("cpu") in group._device_types


def add_host_backend(
    group: dist.ProcessGroup | None,
    timeout_seconds: float = 1800.0,
    store: dist.Store | None = None,
) -> bool:
    """Registers a Gloo backend for CPU tensors on ``group`` where it has none.

    Collective over ``group``: its ranks meet through ``store``, by default
    the store the group was created with. Returns whether a backend was
    added; False for a group that already takes CPU tensors, one of a single
    rank, or one whose store is unknown (zeroshard then sends host data
    through the device and counts each exchange in ``host_sync_counts()``).
    """
    if group is None or group.size() == 1 or has_host_backend(group):
        return False
    store = store if store is not None else store_of(group)
    if store is None:
        return False
    # The ranks of one group give it a channel at the same point of their
    # programs, so the n-th one made for a group name meets the others' n-th.
    name = getattr(group, "group_name", "") or "group"
    count = _channels_made.get(name, 0)
    _channels_made[name] = count + 1
    prefix = f"zeroshard/host_channel/{name}/{count}"
    backend = dist.ProcessGroupGloo(
        dist.PrefixStore(prefix, store),
        group.rank(),
        group.size(),
        datetime.timedelta(seconds=timeout_seconds),
    )
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return True
