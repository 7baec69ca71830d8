"""Converting a DeepSpeed ZeRO checkpoint (stages 1-3) into a zeroshard checkpoint.

DeepSpeed (0.19) writes, per checkpoint tag:

- ``mp_rank_00_model_states.pt`` (stages 1-2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  (stage 3, one per rank): the module's state dict (stage 3: empty placeholders
  for the parameters), ``param_shapes`` (per flat group, the parameter names and
  shapes in flattening order), ``shared_params`` (tied names: alias -> name),
  ``buffer_names``, ``frozen_param_shapes`` / ``frozen_param_fragments``, the
  engine counters (``global_steps``, ``skipped_steps``, ``global_samples``),
  the LR scheduler's state, ``ds_config`` and, at the top level, every key of
  the ``client_state`` passed to ``save_checkpoint``;
- ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, one per data-parallel
  rank: that rank's fp32 partition of each flat group and the inner
  optimizer's state (``exp_avg``, ``exp_avg_sq``, ``step``) for it.

Stages 1-2 partition each parameter group's concatenation (every parameter
followed by its alignment padding, ``param_alignment_paddings``; the group
padded to a multiple of the world size) into equal ranges, rank ``r`` holding
elements ``[r * P, (r + 1) * P)``; the last rank's saved partition has the
group padding cut off (``group_paddings``). Stage 3 partitions every parameter
by itself, padded to the world size: rank ``r`` holds its elements
``[r * p, (r + 1) * p)``, ``p = ceil(numel / world_size)``, and a sub-group's
flat partition is the concatenation of those ranges in ``param_shapes`` order
(``deepspeed/utils/zero_to_fp32.py`` and ``deepspeed/checkpoint/ds_to_universal.py``
read the same layouts).

The converted checkpoint (``docs/design.md``, "Checkpoints") has one
``rank_<r>.safetensors`` per DeepSpeed rank, holding the element ranges that
rank owned, so the conversion reads one DeepSpeed rank file at a time: peak
memory is about one rank's partition of the states (the files are memory-mapped
where torch can). It loads at any world size and stage, like any zeroshard
checkpoint.

What is mapped into ``index.json``'s ``replicated`` entry:

- ``engine``: ``global_steps``, ``skipped_steps`` and ``global_samples`` as
  saved; ``scheduler_steps`` is the scheduler's ``last_batch_iteration + 1``
  (DeepSpeed's schedules evaluate at ``last_batch_iteration``, zeroshard's at
  ``scheduler_steps - 1``), or the steps not skipped when there is no schedule;
  ``micro_steps`` is not saved by DeepSpeed and is taken as ``global_steps x
  gradient_accumulation_steps`` (exact for a save at an accumulation boundary,
  where ``save_checkpoint`` is called);
- ``loss_scaler``: DeepSpeed's scaler (``cur_scale``, ``cur_iter``,
  ``last_overflow_iter``, ``cur_hysteresis``); its overflow count, which
  DeepSpeed does not keep, is ``skipped_steps``;
- ``client_state``: the top-level keys DeepSpeed does not own, also pickled in
  ``client_state.pt`` (what ``Engine.load_checkpoint`` returns, as DeepSpeed's
  ``load_checkpoint`` returns them);
- ``deepspeed``: where the checkpoint came from, and the DeepSpeed entries that
  have no zeroshard counterpart (``unmapped``): the state of a scheduler that
  is not one of DeepSpeed's (no ``last_batch_iteration``), ``data_sampler``
  (curriculum learning) and ``random_ltd``. DeepSpeed saves no RNG state, so
  none is restored.

Parameters the optimizer does not update (frozen or empty) are stored with
their master only (step 0), in the group of the parameter before them in the
module. Not supported (refused with the reason): tensor or pipeline
parallelism (``mp_rank_01`` and up), mixture-of-experts files, ZeRO-3
partition groups smaller than the world (MiCS, AutoEP), NVMe-offloaded states
and optimizers other than Adam, AdamW and SGD.

Unpickling needs no DeepSpeed: its classes in the pickles (the ZeRO stage enum,
the loss scaler, fragment addresses) are read into plain stand-ins. The files
are pickles, so only convert checkpoints you trust.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from zeroshard import _C
from zeroshard._deepspeed_files import (
    _load,
    is_converted,
    is_deepspeed_checkpoint,
    resolve_deepspeed_checkpoint,
)
from zeroshard._deepspeed_reader import _DeepSpeedCheckpoint, _read_rank, _Write

__all__ = [
    "convert_deepspeed_checkpoint",
    "is_converted",
    "is_deepspeed_checkpoint",
    "resolve_deepspeed_checkpoint",
]


def _data_offsets(path: Path) -> dict[str, int]:
    """Each tensor's absolute byte offset in safetensors file ``path``: after the
    8-byte little-endian header size and the JSON header, ``data_offsets[0]`` on."""
    with open(path, "rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_size))
    return {
        name: 8 + header_size + entry["data_offsets"][0]
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> dict[str, int]:
    path.write_bytes(data)
    _fsync(path)
    return {"bytes": len(data), "crc32c": _C.crc32c(data)}


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _write_rank_file(path: Path, writes: list[_Write], rank: int, world_size: int) -> int:
    """Writes one data file; records every piece in its parameter; returns the file's size."""
    try:
        from safetensors.torch import save_file
    except ImportError as error:  # not a dependency of zeroshard itself
        raise ImportError(
            "converting a DeepSpeed checkpoint needs the safetensors package (pip install "
            "safetensors)"
        ) from error
    # Copies: safetensors refuses tensors that share storage, and these are views.
    tensors = {w.key: w.values.detach().reshape(-1).to(torch.float32, copy=True) for w in writes}
    if len(tensors) != len(writes):
        raise ValueError(f"two pieces of {path.name} have the same name")
    metadata = {
        "format": "zeroshard-checkpoint",
        "rank": str(rank),
        "world_size": str(world_size),
        "converted_from": "deepspeed",
    }
    save_file(tensors, str(path), metadata=metadata)
    _fsync(path)
    offsets = _data_offsets(path)
    for write in writes:
        tensor = tensors[write.key]
        write.param.states.setdefault(write.state, []).append(
            {
                "file": rank,
                "begin": write.begin,
                "numel": tensor.numel(),
                "offset": offsets[write.key],
                "crc32c": _C.crc32c(tensor.numpy()),
            }
        )
    return path.stat().st_size


def _publish(staging: Path, target: Path) -> None:
    """Renames the finished ``staging`` directory to ``target``, replacing an older one."""
    _fsync(staging)
    previous = target.with_name(target.name + ".old")
    if previous.exists():
        shutil.rmtree(previous)
    if target.exists():
        os.rename(target, previous)
    os.rename(staging, target)
    _fsync(target.parent)
    if previous.exists():
        shutil.rmtree(previous)


# ---- The conversion -----------------------------------------------------------------


def convert_deepspeed_checkpoint(
    ds_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    tag: str | None = None,
) -> Path:
    """Writes DeepSpeed checkpoint ``ds_dir`` (ZeRO 1-3) as zeroshard checkpoint ``output_path``.

    ``ds_dir`` is a tag directory, or the save directory with ``tag`` (default:
    what its ``latest`` file names). Stores, per parameter (by the module's
    names, tied ones as aliases), the fp32 master, ``exp_avg`` and
    ``exp_avg_sq`` (``max_exp_avg_sq``, ``momentum_buffer`` when present) and
    the step count; per group its hyper-parameters; the engine's counters,
    loss scaler and schedule position, the persistent buffers and the client
    state (the module docstring says what maps where). Reads one DeepSpeed rank
    file at a time. Writes into ``output_path.tmp`` and renames it when
    complete. Returns ``output_path``, which ``Engine.load_checkpoint`` and
    ``ZeroOptimizer.load_checkpoint`` load at any world size and stage.
    """
    checkpoint = _DeepSpeedCheckpoint(resolve_deepspeed_checkpoint(ds_dir, tag))
    target = Path(output_path)
    staging = target.with_name(target.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)  # what an interrupted conversion left
    staging.mkdir(parents=True)
    files = []
    for rank, optim_file in enumerate(checkpoint.optim_files):
        states = _read_rank(_load(optim_file)["optimizer_state_dict"], checkpoint.stage, optim_file)
        writes = []
        for piece in checkpoint.pieces(rank):
            param = checkpoint.params[piece.name]
            param.step = states.steps[piece.flat]
            flats = {"master": states.master[piece.flat], **states.states[piece.flat]}
            for state, flat in flats.items():
                if piece.offset + piece.numel > flat.numel():
                    raise ValueError(
                        f"{optim_file}: {state} of flat group {piece.flat} has {flat.numel()} "
                        f"elements, but {piece.name!r} would end at {piece.offset + piece.numel}"
                    )
                writes.append(
                    _Write(param, state, piece.begin, flat.narrow(0, piece.offset, piece.numel))
                )
        writes += checkpoint.frozen_writes(rank)
        name = f"rank_{rank:05d}.safetensors"
        size = _write_rank_file(staging / name, writes, rank, checkpoint.world_size)
        files.append({"name": name, "bytes": size})
        del states, writes  # one rank's partition at a time

    for param in checkpoint.params.values():
        covered = sum(piece["numel"] for piece in param.states.get("master", []))
        if covered != param.numel:
            raise ValueError(
                f"{checkpoint.path}: the optimizer files hold {covered} of the {param.numel} "
                f"elements of {param.name!r}: a layout this converter does not know"
            )
    index = checkpoint.index(files)
    index["replicated_files"] = {
        "buffers.pt": _write_synced(staging / "buffers.pt", _to_bytes(checkpoint.buffers())),
        "client_state.pt": _write_synced(
            staging / "client_state.pt", _to_bytes(checkpoint.client_state())
        ),
    }
    _write_synced(staging / "index.json", json.dumps(index, indent=1).encode())
    _publish(staging, target)
    return target
