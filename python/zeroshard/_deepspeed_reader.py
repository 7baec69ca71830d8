"""A DeepSpeed 0.19 ZeRO checkpoint read as zeroshard pieces: partition layouts,
states, hyper-parameters and engine counters, one rank file at a time.

Internal to ``zeroshard.deepspeed_migration`` (see its docstring for the layout).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeroshard._deepspeed_files import (
    _DEEPSPEED_KEYS,
    _STATES,
    _as_int,
    _enum_value,
    _load,
    _optim_files,
    _source_files,
)
from zeroshard.checkpoint import _SAFETENSORS_NAMES

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
