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

import bisect
import io
import json
import math
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from zeroshard import _C
from zeroshard.checkpoint import _SAFETENSORS_NAMES

__all__ = [
    "convert_deepspeed_checkpoint",
    "is_converted",
    "is_deepspeed_checkpoint",
    "resolve_deepspeed_checkpoint",
]

_OPTIM_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_STATES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
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


# ---- The layout ---------------------------------------------------------------------


@dataclass
class _Param:
    """One parameter of the converted index; ``states`` fills as its pieces are written."""

    name: str
    shape: list[int]
    dtype: str
    group: int
    aliases: list[str] = field(default_factory=list)
    step: int = 0
    states: dict[str, list[dict[str, int]]] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "aliases": self.aliases,
            "shape": self.shape,
            "dtype": self.dtype,
            "group": self.group,
            "step": self.step,
            "states": self.states,
        }


@dataclass(frozen=True)
class _Piece:
    """Elements ``[begin, begin + numel)`` of a parameter at ``offset`` of a flat partition."""

    name: str
    flat: int  # the flat group (stages 1-2) or sub-group (stage 3)
    offset: int
    begin: int
    numel: int


@dataclass
class _Write:
    """One tensor of a converted data file: a state of a parameter from element ``begin``."""

    param: _Param
    state: str
    begin: int
    values: torch.Tensor

    @property
    def key(self) -> str:
        return f"{self.state}/{self.param.name}/{self.begin}"


def _flat_group_pieces(
    groups: Sequence[Sequence[tuple[str, int, int]]], partition_sizes: Sequence[int], rank: int
) -> Iterator[_Piece]:
    """Stages 1-2: what rank ``rank`` holds of each group's concatenation.

    ``groups[g]`` lists ``(name, numel, alignment padding)`` in flattening order;
    the rank holds elements ``[rank * P, (rank + 1) * P)`` of the concatenation.
    """
    for g, params in enumerate(groups):
        low, high = rank * partition_sizes[g], (rank + 1) * partition_sizes[g]
        start = 0
        for name, numel, padding in params:
            first, last = max(start, low), min(start + numel, high)
            if first < last:
                yield _Piece(name, g, first - low, first - start, last - first)
            start += numel + padding


def _per_param_pieces(
    sub_groups: Sequence[Sequence[tuple[str, int, int]]], world_size: int, rank: int
) -> Iterator[_Piece]:
    """Stage 3: each parameter split by itself, ``ceil(numel / world_size)`` per rank."""
    for i, params in enumerate(sub_groups):
        offset = 0
        for name, numel, _ in params:
            per_rank = math.ceil(numel / world_size)
            count = max(0, min(per_rank, numel - rank * per_rank))
            if count:
                yield _Piece(name, i, offset, rank * per_rank, count)
            offset += per_rank


# ---- Reading an optimizer file ------------------------------------------------------


@dataclass
class _RankStates:
    """One rank's flat partitions: per flat index the fp32 master, the inner
    optimizer's states, its step, its param group and that group's settings."""

    master: list[torch.Tensor]
    states: list[dict[str, torch.Tensor]]
    steps: list[int]
    groups: list[int]
    settings: list[dict[str, Any]]


def _inner_state(
    optimizer_state: Mapping[str, Any], index: int
) -> tuple[dict[str, Any], int, dict[str, Any]]:
    """State, group number and group of parameter ``index`` of a torch optimizer state dict."""
    for g, group in enumerate(optimizer_state["param_groups"]):
        if index in group["params"]:
            return dict(optimizer_state["state"].get(index, {})), g, group
    raise ValueError(f"the inner optimizer's state has no parameter {index}")


def _read_rank(osd: Mapping[str, Any], stage: int, file: Path) -> _RankStates:
    """The flat partitions of one ``*_optim_states.pt``'s ``optimizer_state_dict``."""
    if stage == 3:
        masters = list(osd["fp32_flat_groups"])
        entries = [_inner_state(osd["optimizer_state_dict"], i) for i in range(len(masters))]
    else:
        masters = list(osd["single_partition_of_fp32_groups"])
        base = osd["base_optimizer_state"]
        if isinstance(base, Mapping):  # the inner optimizer's state_dict(): one flat per group
            entries = [_inner_state(base, group["params"][0]) for group in base["param_groups"]]
        else:  # elastic checkpoint: a lean state per group, the step beside
            step = osd.get("base_optimizer_state_step")
            entries = [
                ({"step": step, **state} if step is not None else dict(state), g, {})
                for g, state in enumerate(base)
            ]
    if len(entries) != len(masters):
        raise ValueError(f"{file}: {len(masters)} flat groups but {len(entries)} optimizer states")
    out = _RankStates(masters, [], [], [], [])
    for state, group, settings in entries:
        out.states.append(
            {k: v for k, v in state.items() if k in _STATES and isinstance(v, torch.Tensor)}
        )
        out.steps.append(_as_int(state.get("step", 0)))
        out.groups.append(group)
        out.settings.append(settings)
    return out


# ---- Hyper-parameters ---------------------------------------------------------------


def _inner_optimizer(ds_config: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """zeroshard's name for the optimizer DeepSpeed ran: ``adamw``, ``adam`` or ``sgd``."""
    spec = ds_config.get("optimizer")
    if spec:
        kind = str(spec.get("type", "")).lower()
        if kind not in ("adam", "adamw"):
            raise ValueError(
                f"DeepSpeed optimizer {spec.get('type')!r} has no zeroshard counterpart "
                "(Adam, AdamW and SGD do)"
            )
        # DeepSpeed runs "Adam" with decoupled weight decay unless adam_w_mode is false.
        adam_w_mode = (spec.get("params") or {}).get("adam_w_mode", True)
        return "adamw" if kind == "adamw" or adam_w_mode else "adam"
    # A client optimizer (torch.optim): tell it by its param group's keys.
    if "momentum" in settings and "nesterov" in settings:
        return "sgd"
    if "betas" in settings:
        return "adam" if settings.get("decoupled_weight_decay") is False else "adamw"
    raise ValueError(f"cannot tell which optimizer has param group keys {sorted(settings)}")


def _hyperparameters(
    inner: str, settings: Mapping[str, Any], ds_config: Mapping[str, Any]
) -> dict[str, Any]:
    """A group's hyper-parameters as zeroshard's index holds them."""
    # The saved param group wins; the config (and torch's defaults) fill its gaps.
    values = {**((ds_config.get("optimizer") or {}).get("params") or {}), **settings}
    if values.get("bias_correction", True) is False:
        raise ValueError("DeepSpeed's Adam ran without bias correction, which zeroshard has not")
    if inner == "sgd":
        return {
            "lr": float(values.get("lr", 1e-3)),
            "momentum": float(values.get("momentum", 0.0)),
            "dampening": float(values.get("dampening", 0.0)),
            "weight_decay": float(values.get("weight_decay", 0.0)),
            "nesterov": bool(values.get("nesterov", False)),
        }
    betas = values.get("betas", (0.9, 0.999))
    return {
        "lr": float(values.get("lr", 1e-3)),
        "betas": [float(betas[0]), float(betas[1])],
        "eps": float(values.get("eps", 1e-8)),
        "weight_decay": float(values.get("weight_decay", 0.0)),
        "amsgrad": bool(values.get("amsgrad", False)),
    }


# ---- Engine state -------------------------------------------------------------------


def _batch_settings(ds_config: Mapping[str, Any], world_size: int) -> tuple[int, int]:
    """``(gradient_accumulation_steps, train_batch_size)`` as DeepSpeed derives them."""
    batch = ds_config.get("train_batch_size")
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    accumulation = ds_config.get("gradient_accumulation_steps")
    if accumulation is None:
        accumulation = batch // (micro * world_size) if batch and micro else 1
    if batch is None:
        batch = (micro or 1) * accumulation * world_size
    return int(accumulation), int(batch)


def _loss_scaler_state(scaler: Any, global_steps: int, skipped_steps: int) -> list[float] | None:
    """DeepSpeed's loss scaler as the numbers of zeroshard's ``LossScaler::state()``.

    A static scaler (fp32, bf16, a fixed fp16 scale) keeps only its scale; it has
    been updated once per step.
    """
    attributes = getattr(scaler, "__dict__", {})
    if "cur_scale" not in attributes:
        return None
    iteration = int(attributes.get("cur_iter", global_steps))
    return [
        1.0,  # the state's format
        1.0 if attributes.get("dynamic") else 0.0,
        float(attributes["cur_scale"]),
        float(iteration),
        float(attributes.get("last_overflow_iter", -1)),
        float(attributes.get("cur_hysteresis", 1)),
        float(min(skipped_steps, iteration)),  # DeepSpeed skips exactly the overflowed steps
    ]


def _engine_state(
    model: Mapping[str, Any], ds_config: Mapping[str, Any], world_size: int
) -> tuple[dict[str, Any], list[str]]:
    """``replicated["engine"]`` and the DeepSpeed entries left unmapped."""
    global_steps = int(model.get("global_steps", 0))
    skipped = int(model.get("skipped_steps", 0))
    accumulation, batch = _batch_settings(ds_config, world_size)
    scheduler = model.get("lr_scheduler")
    unmapped = [key for key in ("data_sampler", "random_ltd") if model.get(key) is not None]
    if isinstance(scheduler, Mapping) and "last_batch_iteration" in scheduler:
        scheduler_steps = int(scheduler["last_batch_iteration"]) + 1
    else:
        scheduler_steps = global_steps - skipped  # what zeroshard counts without a schedule
        if scheduler is not None:
            unmapped.append("lr_scheduler")
    engine = {
        "global_steps": global_steps,
        "micro_steps": global_steps * accumulation,
        "skipped_steps": skipped,
        "scheduler_steps": scheduler_steps,
        "global_samples": int(model.get("global_samples", global_steps * batch)),
        "train_batch_size": batch,
        "world_size": world_size,
    }
    return engine, unmapped


# ---- The checkpoint's metadata ------------------------------------------------------


def _dtype_name(tensor: Any, ds_config: Mapping[str, Any]) -> str:
    """The training dtype's safetensors name: the module state's, else the config's."""
    if isinstance(tensor, torch.Tensor) and tensor.dtype in _SAFETENSORS_NAMES:
        return _SAFETENSORS_NAMES[tensor.dtype]
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):
        return "BF16"
    if (ds_config.get("fp16") or {}).get("enabled"):
        return "F16"
    return "F32"


class _DeepSpeedCheckpoint:
    """What rank 0's files say about a DeepSpeed checkpoint: stage, parameters, layout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.optim_files = _optim_files(path)
        self.world_size = len(self.optim_files)
        optim0 = _load(self.optim_files[0])["optimizer_state_dict"]
        # The bf16 optimizer (bf16 at stage 1) stores no stage; it has stage 1's layout.
        self.stage = int(_enum_value(optim0.get("zero_stage", 1)))
        counts = optim0.get("partition_count", self.world_size)
        counts = list(counts) if isinstance(counts, list | tuple) else [counts]
        if any(int(c) != self.world_size for c in counts) or optim0.get("ds_zero_partition_groups"):
            raise ValueError(
                f"{path}: partitions over {counts} ranks but {self.world_size} optimizer files "
                "(expert, MiCS or AutoEP partition groups are not supported)"
            )
        model_name = (
            "zero_pp_rank_0_mp_rank_00_model_states.pt"
            if self.stage == 3
            else "mp_rank_00_model_states.pt"
        )
        if not (path / model_name).exists():
            raise FileNotFoundError(f"{path} has no {model_name}")
        self.model = _load(path / model_name)
        if not self.model.get("param_shapes"):
            raise ValueError(f"{path / model_name} has no param_shapes: not a ZeRO checkpoint")
        self.ds_config: dict[str, Any] = dict(self.model.get("ds_config") or {})
        zero = self.ds_config.get("zero_optimization") or {}
        if (zero.get("offload_optimizer") or {}).get("device") == "nvme":
            raise ValueError(
                f"{path} was saved with the optimizer state offloaded to NVMe, which is not "
                "in its files: not supported"
            )
        self.module: Mapping[str, Any] = self.model.get("module") or {}
        self.loss_scaler = _loss_scaler_state(
            optim0.get("loss_scaler"),
            int(self.model.get("global_steps", 0)),
            int(self.model.get("skipped_steps", 0)),
        )
        rank0 = _read_rank(optim0, self.stage, self.optim_files[0])
        self.inner = _inner_optimizer(self.ds_config, rank0.settings[0])
        self.group_settings: dict[int, dict[str, Any]] = {}
        for group, settings in zip(rank0.groups, rank0.settings, strict=True):
            self.group_settings.setdefault(group, settings)

        # Registration order, as far as the module state tells it.
        self.order = {name: i for i, name in enumerate(self.module)}
        shared: Mapping[str, str] = self.model.get("shared_params") or {}
        aliases: dict[str, list[str]] = {}
        for alias, name in shared.items():
            aliases.setdefault(name, []).append(alias)

        # The optimized parameters by flat group (stages 1-2) or sub-group (stage 3):
        # (name, numel, alignment padding after it) in flattening order.
        shapes_by_flat = list(self.model["param_shapes"])
        if len(shapes_by_flat) != len(rank0.master):
            raise ValueError(
                f"{path}: param_shapes lists {len(shapes_by_flat)} flat groups but "
                f"{self.optim_files[0].name} holds {len(rank0.master)}"
            )
        paddings = optim0.get("param_alignment_paddings") or [[]] * len(shapes_by_flat)
        self.flats: list[list[tuple[str, int, int]]] = []
        self.params: dict[str, _Param] = {}
        for flat, shapes in enumerate(shapes_by_flat):
            entries = []
            for j, (name, shape) in enumerate(shapes.items()):
                padding = paddings[flat][j] if self.stage < 3 and j < len(paddings[flat]) else 0
                entries.append((name, math.prod(shape), int(padding)))
                self.params[name] = _Param(
                    name,
                    [int(s) for s in shape],
                    _dtype_name(self.module.get(name), self.ds_config),
                    rank0.groups[flat],
                    aliases=sorted(aliases.get(name, []), key=self._position),
                )
            self.flats.append(entries)
        # Stages 1-2: rank 0 holds a whole partition; the saved one of the last rank
        # lacks the group's padding (the bf16 optimizer keeps it, and saves no stage).
        group_paddings = optim0.get("group_paddings") or [0] * len(rank0.master)
        trimmed = "zero_stage" in optim0 and self.world_size == 1
        self.partition_sizes = [
            master.numel() + (int(group_paddings[g]) if trimmed else 0)
            for g, master in enumerate(rank0.master)
        ]
        self.frozen = self._frozen_params(set(shared))

    def _position(self, name: str) -> int:
        return self.order.get(name, len(self.order))

    def _frozen_params(self, aliases: set[str]) -> list[_Param]:
        """Parameters outside the optimizer (frozen or empty), which zeroshard registers too.

        Stages 1-2 keep their values in the module state, stage 3 in every rank's
        ``frozen_param_fragments``. Each joins the group of the parameter before
        it in the module (group 0 if none), where ``model.parameters()`` puts it.
        """
        shapes = dict(self.model.get("frozen_param_shapes") or {})
        if self.stage < 3:  # stage 1 saves no frozen_param_shapes
            skip = aliases | set(self.model.get("buffer_names") or []) | set(shapes)
            for name, value in self.module.items():
                if name not in self.params and name not in skip:
                    shapes[name] = value.shape
        optimized = sorted(self.params.values(), key=lambda p: self._position(p.name))
        positions = [self._position(p.name) for p in optimized]
        frozen = []
        for name, shape in shapes.items():
            before = bisect.bisect_left(positions, self._position(name))
            frozen.append(
                _Param(
                    name,
                    [int(s) for s in shape],
                    _dtype_name(self.module.get(name), self.ds_config),
                    optimized[before - 1].group if before else 0,
                )
            )
        return frozen

    def pieces(self, rank: int) -> Iterator[_Piece]:
        """The ranges of the optimized parameters in rank ``rank``'s optimizer file."""
        if self.stage == 3:
            return _per_param_pieces(self.flats, self.world_size, rank)
        return _flat_group_pieces(self.flats, self.partition_sizes, rank)

    def frozen_writes(self, rank: int) -> list[_Write]:
        """The master pieces of the frozen parameters that go into rank ``rank``'s file."""
        frozen = [p for p in self.frozen if p.numel]
        if not frozen:
            return []
        if self.stage < 3:  # whole, in the module state (stage 2: also in the fragments)
            if rank > 0:
                return []
            whole = {**self.module, **(self.model.get("frozen_param_fragments") or {})}
            return [_Write(p, "master", 0, whole[p.name].reshape(-1)) for p in frozen]
        rank_model = _load(self.path / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        fragments = rank_model.get("frozen_param_fragments") or {}
        writes = []
        for param in frozen:
            per_rank = math.ceil(param.numel / self.world_size)
            count = max(0, min(per_rank, param.numel - rank * per_rank))
            if count:
                values = fragments[param.name].reshape(-1).narrow(0, 0, count)
                writes.append(_Write(param, "master", rank * per_rank, values))
        return writes

    def index(self, files: list[dict[str, Any]]) -> dict[str, Any]:
        """``index.json`` (after every rank file is written)."""
        everything = sorted(
            [*self.params.values(), *self.frozen], key=lambda p: self._position(p.name)
        )
        for param in everything:
            if param.numel == 0:
                param.states.setdefault("master", [])
        group_count = 1 + max((p.group for p in everything), default=0)
        zero = self.ds_config.get("zero_optimization") or {}
        offload = (zero.get("offload_optimizer") or {}).get("device", "none")
        engine, unmapped = _engine_state(self.model, self.ds_config, self.world_size)
        return {
            "format": "zeroshard-checkpoint",
            "format_version": 1,
            "zeroshard_version": "0.1.0",
            "world_size": self.world_size,
            "stage": self.stage,
            "inner_optimizer": self.inner,
            "offload_optimizer": "cpu" if offload == "cpu" else "none",
            "reduce_bucket_size": int(zero.get("reduce_bucket_size", 500_000_000)),
            "files": files,
            "groups": [
                {
                    "hyperparameters": _hyperparameters(
                        self.inner, self.group_settings.get(g, {}), self.ds_config
                    ),
                    "params": [p.name for p in everything if p.group == g],
                }
                for g in range(group_count)
            ],
            "params": [p.to_json() for p in everything],
            "replicated": {
                "engine": engine,
                "loss_scaler": self.loss_scaler,
                "client_state": {},  # as zeroshard's Python engine saves it: pickled beside
                "deepspeed": {
                    "path": str(self.path),
                    "ds_version": self.model.get("ds_version"),
                    "stage": self.stage,
                    "world_size": self.world_size,
                    "source_files": _source_files(self.path),
                    "unmapped": unmapped,
                },
            },
            "replicated_files": {},
            "rank_files": [{} for _ in files],
        }

    def buffers(self) -> dict[str, torch.Tensor]:
        """The module's persistent buffers (whole at every stage)."""
        names = self.model.get("buffer_names") or []
        return {name: self.module[name].detach().clone() for name in names if name in self.module}

    def client_state(self) -> dict[str, Any]:
        """The model-states keys that are not DeepSpeed's: ``save_checkpoint``'s client_state."""
        return {k: v for k, v in self.model.items() if k not in _DEEPSPEED_KEYS}


# ---- Writing ------------------------------------------------------------------------


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
