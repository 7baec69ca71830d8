"""DeepSpeed 0.19 checkpoint files: finding them and unpickling them without DeepSpeed.

Internal to ``zeroshard.deepspeed_migration`` (see its docstring for the layout).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

from zeroshard import _C

_OPTIM_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# The moments a shard may hold (the master aside), by torch.optim's names,
# which DeepSpeed's files use too: one list, optimizer_states.h's.
_STATES = tuple(name for name in _C.optimizer_state_names() if name != "master")
# Top-level keys of DeepSpeed's model-states file that are DeepSpeed's own;
# every other key came from save_checkpoint's client_state.
_DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
        "num_experts",
    }
)


# ---- Unpickling without DeepSpeed ---------------------------------------------------


class _DeepSpeedObject:
    """Stands in for a DeepSpeed class in a pickle: keeps the constructor
    arguments (``args``; an enum's value) and the pickled attributes."""

    args: tuple[Any, ...]

    def __new__(cls, *args: Any, **kwargs: Any) -> _DeepSpeedObject:
        instance = super().__new__(cls)
        instance.args = args
        return instance

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ values)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


_STAND_INS: dict[tuple[str, str], type[_DeepSpeedObject]] = {}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            key = (module, name)
            if key not in _STAND_INS:
                _STAND_INS[key] = type(name, (_DeepSpeedObject,), {"__module__": __name__})
            return _STAND_INS[key]
        return super().find_class(module, name)


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs of a pickle module."""

    Unpickler = _Unpickler

    @staticmethod
    def load(file: BinaryIO, **kwargs: Any) -> Any:
        return _Unpickler(file, **kwargs).load()


def _load(path: Path) -> dict[str, Any]:
    """A DeepSpeed ``.pt`` file, tensors memory-mapped when its format allows."""
    try:
        return torch.load(
            path,
            map_location="cpu",
            weights_only=False,  # DeepSpeed pickles its own objects; see the module docstring
            mmap=zipfile.is_zipfile(path),
            pickle_module=_PickleModule,
        )
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as error:
        raise ValueError(f"cannot read DeepSpeed checkpoint file {path}: {error}") from error


def _enum_value(value: Any) -> Any:
    """The value of a pickled DeepSpeed enum (or the value itself)."""
    if isinstance(value, _DeepSpeedObject) and value.args:
        return value.args[0]
    return value


def _as_int(value: Any) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


# ---- Finding the files --------------------------------------------------------------


def _optim_files(path: Path) -> list[Path]:
    """The ``*_optim_states.pt`` files of checkpoint directory ``path``, by rank."""
    found: dict[int, Path] = {}
    for entry in path.iterdir():
        match = _OPTIM_FILE.match(entry.name)
        if match is None:
            continue
        rank, mp_rank = int(match.group(1)), int(match.group(2))
        if mp_rank != 0:
            raise ValueError(
                f"{entry} belongs to model-parallel rank {mp_rank}: checkpoints of tensor or "
                "pipeline parallel runs are not supported"
            )
        if rank in found:
            raise ValueError(f"{path} holds two optimizer files for rank {rank}")
        found[rank] = entry
    if not found:
        raise FileNotFoundError(f"{path} has no DeepSpeed *_optim_states.pt files")
    if sorted(found) != list(range(len(found))):
        missing = sorted(set(range(max(found) + 1)) - set(found))
        raise ValueError(f"{path} lacks the optimizer files of ranks {missing}")
    return [found[r] for r in range(len(found))]


def is_deepspeed_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory (a tag's) rather than zeroshard's."""
    root = Path(path)
    if not root.is_dir() or (root / "index.json").exists():
        return False
    return any(_OPTIM_FILE.match(entry.name) for entry in root.iterdir())


def resolve_deepspeed_checkpoint(ds_dir: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The tag directory: ``ds_dir/tag``, ``ds_dir`` itself, or what ``ds_dir/latest`` names."""
    root = Path(ds_dir)
    if tag:
        return root / tag
    if is_deepspeed_checkpoint(root):
        return root
    if (root / "latest").exists():
        return root / _C.read_latest_tag(str(root))
    raise FileNotFoundError(
        f"{root} is not a DeepSpeed checkpoint: it has no *_optim_states.pt files and no "
        "latest file; pass the tag"
    )


def _source_files(path: Path) -> dict[str, list[int]]:
    """``{name: [bytes, mtime_ns]}`` of the DeepSpeed files, to tell a stale conversion."""
    return {
        entry.name: [entry.stat().st_size, entry.stat().st_mtime_ns]
        for entry in sorted(path.iterdir())
        if entry.name.endswith(".pt")
    }


def is_converted(source: str | os.PathLike[str], converted: str | os.PathLike[str]) -> bool:
    """Whether ``converted`` is a conversion of DeepSpeed checkpoint ``source`` as it is now."""
    index_path = Path(converted) / "index.json"
    if not index_path.exists():
        return False
    try:
        recorded = json.loads(index_path.read_text())["replicated"]["deepspeed"]["source_files"]
    except (ValueError, KeyError, TypeError):
        return False
    return recorded == _source_files(Path(source))
