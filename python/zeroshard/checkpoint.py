"""Consolidating a zeroshard checkpoint into whole tensors (Hugging Face layout).

A checkpoint directory (see ``docs/design.md``, "Checkpoints") stores every
state as pieces: element ranges of named parameters, spread over one
safetensors file per saving rank. This module reassembles the fp32 master
weights one parameter at a time, checksums verified, so peak memory is about
the largest parameter, whatever the model's size.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from zeroshard import _C

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


def resolve_checkpoint(checkpoint: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The checkpoint directory: ``checkpoint/tag``, ``checkpoint``, or what ``latest`` names."""
    root = Path(checkpoint)
    if tag:
        return root / tag
    if (root / "index.json").exists():
        return root
    if (root / "latest").exists():
        return root / _C.read_latest_tag(str(root))
    raise FileNotFoundError(
        f"{root} is not a zeroshard checkpoint: it has neither index.json nor a latest file"
    )


# csrc/include/zeroshard/checkpoint.h's kCheckpointFormatVersion: 2 added
# strided pieces (tensor parallelism).
_FORMAT_VERSION = 2


def read_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``index.json`` of checkpoint directory ``path``."""
    index_path = Path(path) / "index.json"
    if not index_path.exists():
        raise FileNotFoundError(f"no zeroshard checkpoint at {path}: {index_path} is missing")
    index = json.loads(index_path.read_text())
    if index.get("format") != "zeroshard-checkpoint":
        raise ValueError(f"{index_path} is not a zeroshard checkpoint index")
    version = index.get("format_version", 0)
    if not 1 <= version <= _FORMAT_VERSION:
        raise ValueError(
            f"{index_path} has format version {version}; this build reads versions 1 to "
            f"{_FORMAT_VERSION}"
        )
    return index


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"1.5GiB"`` or a byte count, as bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not match:
        raise ValueError(f"cannot read size {text!r}: expected e.g. 5GB, 500MB or 1.5GiB")
    base = 1024 if match.group(3) else 1000
    power = " KMGT".index(match.group(2) or " ")
    return int(float(match.group(1)) * base**power)


class _PieceReader:
    """Reads parameters from a checkpoint's pieces, keeping its files open."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path = path
        self.index = index
        self._files: dict[int, BinaryIO] = {}

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def _file(self, number: int) -> BinaryIO:
        if number not in self._files:
            name = self.path / self.index["files"][number]["name"]
            if not name.exists():
                raise FileNotFoundError(
                    f"checkpoint file {name} is missing (saved by rank {number})"
                )
            self._files[number] = open(name, "rb")  # noqa: SIM115 - closed in close()
        return self._files[number]

    def master(self, param: dict[str, Any]) -> torch.Tensor:
        """The whole fp32 master of one parameter, in its shape."""
        return self.state(param, "master")

    def state(self, param: dict[str, Any], state: str) -> torch.Tensor:
        """One whole fp32 state (``master``, ``exp_avg``, ...) of one parameter, in
        its shape: the parameter's, or a state's own (Adafactor's ``row_var``;
        [Note: parameter states] in update_rule.h)."""
        shape = param.get("state_shapes", {}).get(state, param["shape"])
        numel = math.prod(shape)
        full = torch.empty(numel, dtype=torch.float32)
        view = full.numpy().view("uint8")
        covered = 0
        for piece in param["states"].get(state, []):
            begin, count = piece["begin"], piece["numel"]
            # A tensor-parallel piece split along a later dimension: runs of
            # `run` elements `stride` apart in the unsplit tensor.
            run = piece.get("run", count)
            strided = run != count
            if strided:
                buffer = torch.empty(count, dtype=torch.float32)
                target = buffer.numpy().view("uint8")
            else:
                target = view[begin * 4 : (begin + count) * 4]
            handle = self._file(piece["file"])
            handle.seek(piece["offset"])
            if handle.readinto(memoryview(target)) != count * 4:
                raise ValueError(f"checkpoint file {handle.name} is truncated")
            if _C.crc32c(target) != piece["crc32c"]:
                raise ValueError(
                    f"checksum mismatch in {handle.name} for {state} of parameter "
                    f"{param['name']!r} (the piece from element {begin}): the file is corrupt"
                )
            if strided:
                rows = full.as_strided((count // run, run), (piece["stride"], 1), begin)
                rows.copy_(buffer.view(-1, run))
            covered += count
        if covered != numel:
            raise ValueError(
                f"checkpoint {self.path} covers {covered} of the {numel} elements of "
                f"{state} of parameter {param['name']!r}"
            )
        return full.view(shape)


def read_states(
    checkpoint: str | os.PathLike[str], tag: str | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """Every saved state of every parameter, whole: ``{state: {name: tensor}}``.

    For inspection and tests; holds the whole optimizer state in memory.
    """
    path = resolve_checkpoint(checkpoint, tag)
    index = read_index(path)
    reader = _PieceReader(path, index)
    out: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for param in index["params"]:
            names = set(param["states"]) | {"master"}
            for state in sorted(names):
                if state in param["states"] or math.prod(param["shape"]) == 0:
                    out.setdefault(state, {})[param["name"]] = reader.state(param, state)
    finally:
        reader.close()
    return out


def _output_dtype(param: dict[str, Any], dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return _SAFETENSORS_DTYPES[param["dtype"]]
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _buffers(path: Path, index: dict[str, Any]) -> dict[str, torch.Tensor]:
    record = index.get("replicated_files", {}).get("buffers.pt")
    if record is None:
        return {}
    data = (path / "buffers.pt").read_bytes()
    if _C.crc32c(data) != record["crc32c"]:
        raise ValueError(f"checkpoint file {path / 'buffers.pt'} is corrupt")
    return torch.load(io.BytesIO(data), weights_only=True)


def iter_consolidated(
    checkpoint: str | os.PathLike[str],
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` per parameter (canonical names), then buffers.

    One parameter is held at a time. ``dtype`` defaults to each parameter's
    training dtype; ``"fp32"`` gives the master weights as they are.
    """
    path = resolve_checkpoint(checkpoint, tag)
    index = read_index(path)
    reader = _PieceReader(path, index)
    try:
        for param in index["params"]:
            yield param["name"], reader.master(param).to(_output_dtype(param, dtype))
    finally:
        reader.close()
    yield from _buffers(path, index).items()


def consolidated_state_dict(
    checkpoint: str | os.PathLike[str],
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The full model state of a checkpoint, keyed as ``module.state_dict()``.

    Tied parameters appear under every name, as one tensor, so
    ``model.load_state_dict(consolidated_state_dict(path))`` works as is.
    """
    path = resolve_checkpoint(checkpoint, tag)
    aliases = {p["name"]: p["aliases"] for p in read_index(path)["params"]}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in iter_consolidated(path, dtype=dtype):
        out[name] = tensor
        for alias in aliases.get(name, []):
            out[alias] = tensor
    return out


def consolidate(
    checkpoint: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
) -> list[Path]:
    """Writes a checkpoint's weights in the Hugging Face layout; returns the files.

    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` when the weights exceed
    ``max_shard_size``. Tied weights are written once, under their first name
    (as ``save_pretrained`` does); ``safetensors.torch.load_model`` and
    ``from_pretrained`` restore the ties. Streams one parameter at a time.
    """
    path = resolve_checkpoint(checkpoint, tag)
    index = read_index(path)
    limit = parse_size(max_shard_size)
    buffers = _buffers(path, index)
    entries: list[tuple[str, torch.dtype, list[int]]] = [
        (p["name"], _output_dtype(p, dtype), list(p["shape"])) for p in index["params"]
    ]
    entries += [(name, b.dtype, list(b.shape)) for name, b in buffers.items()]
    shards: list[list[tuple[str, torch.dtype, list[int]]]] = [[]]
    shard_bytes = 0
    total = 0
    for entry in entries:
        size = math.prod(entry[2]) * torch.empty((), dtype=entry[1]).element_size()
        if shards[-1] and shard_bytes + size > limit:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += size
        total += size
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    by_name = {p["name"]: p for p in index["params"]}
    reader = _PieceReader(path, index)
    written: list[Path] = []
    try:
        for file_name, shard in zip(names, shards, strict=True):
            writer = _C.SafetensorsWriter(
                str(out_dir / file_name),
                [(name, _SAFETENSORS_NAMES[d], shape) for name, d, shape in shard],
                {"format": "pt"},
            )
            for name, out_dtype, _ in shard:
                if name in by_name:
                    tensor = reader.master(by_name[name]).to(out_dtype)
                else:
                    tensor = buffers[name]
                writer.append(tensor.contiguous())
                del tensor
            writer.finish()
            written.append(out_dir / file_name)
    finally:
        reader.close()
    if len(shards) > 1:
        weight_map = {
            name: file for file, shard in zip(names, shards, strict=True) for name, *_ in shard
        }
        index_file = out_dir / "model.safetensors.index.json"
        index_file.write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        written.append(index_file)
    return written
