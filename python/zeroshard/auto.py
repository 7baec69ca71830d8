"""``"auto"`` in a DeepSpeed config: the stage and offload devices chosen from what is free.

The decision is the C++ core's (``zeroshard::resolve_auto_configuration``:
the estimator's cheapest configuration whose ``device_bytes`` per rank fit, the
whole peak on the device: parameters, gradients and their buckets and
staging buffers, optimizer states, stage 3's gathered units, the step's fp32
transient, activations when counted; and whose host and NVMe bytes fit the
node's); this module measures what
this rank has free (device memory, the node's RAM, the disk under the offload
sections' ``nvme_path``), agrees on the minimum over the ranks so that every
rank decides alike, and prints the decision on rank 0.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.estimator import activation_bytes, count_model, parse_bytes


def _host_available_bytes() -> float:
    """The node's MemAvailable (what the kernel can give without swapping)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def _disk_free_bytes(paths: tuple[str, str]) -> float:
    """Free bytes under the given nvme_paths (the smallest), -1 when none exists."""
    free = [shutil.disk_usage(p).free for p in paths if p and os.path.isdir(p)]
    return float(min(free)) if free else -1.0


def resolve_auto(
    parsed: object,
    model: nn.Module,
    process_group: dist.ProcessGroup,
    memory_limit: float | str | None = None,
    sequence_length: int | None = None,
    replicate_group: dist.ProcessGroup | None = None,
) -> str:
    """Resolves the config's ``"auto"`` settings in place; returns the decision.

    Args:
        parsed: the C++ ``DeepSpeedConfig`` (``_C.parse_deepspeed_config``).
        model: its parameters and largest stage-3 unit are counted.
        process_group: the data-parallel (shard) group the ranks agree over.
        replicate_group: with hybrid sharding, the replicas agree too (every
            rank must choose the same configuration).
        memory_limit: at most this much memory per rank is planned for (on the
            training device; on a CPU device, RAM): e.g. ``"8GB"`` to leave
            room for activations. Default: what is free.
        sequence_length: tokens per sequence: with it, the activations of a
            micro-batch of a transformer whose ``model.config`` gives its
            shape (:func:`zeroshard.estimator.activation_bytes`) are counted
            on the device too.

    Raises:
        ValueError: on every rank, when nothing fits, naming what is short.
    """
    if any(hasattr(p, "placements") for p in model.parameters()):
        raise ValueError(
            '"auto" does not support tensor-parallel (DTensor) models yet: it would count '
            "global sizes on every rank; set zero_optimization.stage and the offload devices"
        )
    num_params, largest_unit = count_model(model)
    world_size = dist.get_world_size(process_group)
    params = list(model.parameters())
    meta = any(p.is_meta for p in params)
    backend = str(dist.get_backend(process_group))
    # The training device: the parameters' (a meta model is materialized on
    # the GPU when the group has NCCL).
    on_gpu = any(p.is_cuda for p in params) or (meta and "nccl" in backend)
    ranks_per_node = float(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # Measured before any collective; a rank that cannot measure plans for
    # nothing (0), and the agreed minimum makes every rank fail alike.
    host = device = 0.0
    try:
        host = _host_available_bytes()
        if on_gpu:
            device = float(torch.cuda.mem_get_info()[0])
        if memory_limit is not None:
            limit = parse_bytes(memory_limit)
            host = min(host, limit * ranks_per_node) if not on_gpu else host
            device = min(device, limit) if on_gpu else device
    except (OSError, RuntimeError, ValueError):
        host = device = 0.0
    disk = _disk_free_bytes(tuple(parsed.nvme_paths))
    # The minimum over ranks (disk: -1 anywhere means no NVMe for anyone);
    # ranks per node, the largest any rank reports.
    agreed = torch.tensor(
        [device, host, disk, -ranks_per_node],
        dtype=torch.float64,
        device="cuda" if "nccl" in backend else "cpu",
    )
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=process_group)
    if replicate_group is not None:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=replicate_group)
    device, host, disk, ranks = (float(x) for x in agreed.cpu())
    precision = "mixed16" if parsed.bf16 or parsed.fp16 else "fp32"
    micro_batch = int(parsed.train_micro_batch_size_per_gpu)
    activations = (
        activation_bytes(model, micro_batch, sequence_length, precision=precision)
        if sequence_length
        else None
    )
    if activations is None:
        counted = (
            "Activations are not counted: pass sequence_length= for a model whose "
            "config gives its shape, or leave room for them with memory_limit=."
        )
    else:
        counted = (
            f"Counted with {activations / 1e9:.3f} GB of activations per rank (micro-batch "
            f"{micro_batch}, {sequence_length} tokens)."
        )
    decision = parsed.resolve_auto(
        float(num_params),
        float(largest_unit),
        int(-ranks),
        device,
        host,
        disk,
        not on_gpu,
        # Only stage 3 builds meta models and has units.
        meta or bool(parsed.unit_classes),
        activations or 0.0,
    )
    decision = f"{decision} {counted}"
    if dist.get_rank(process_group) == 0:
        print(f"[zeroshard] {decision}", flush=True)
    return decision
