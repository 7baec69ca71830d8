"""``zeroshard.initialize``: a DeepSpeed-style engine over the C++ core.

The config (a path or a dict, DeepSpeed's JSON) is parsed and validated in C++
(``csrc/config/deepspeed_config.cpp``); the engine's step logic (accumulation
boundaries, loss scaling, overflow skipping, LR schedule, telemetry) is the
C++ ``zeroshard::Engine``. This module only wires them to a Python model.
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import _C, deepspeed_migration
from zeroshard.auto import resolve_auto
from zeroshard.checkpointing import _IN_FLIGHT
from zeroshard.deepspeed_muon import muon_param_groups
from zeroshard.groups import data_parallel_groups, hybrid_groups
from zeroshard.optimizer import ZeroOptimizer
from zeroshard.units import resolve_unit_classes


def _load_config(config: str | os.PathLike | dict[str, Any], world_size: int) -> Any:
    if isinstance(config, dict):
        return _C.parse_deepspeed_config(json.dumps(config), world_size)
    if isinstance(config, str | os.PathLike):
        return _C.load_deepspeed_config(os.fspath(config), world_size)
    raise TypeError(f"config must be a path or a dict, got {type(config).__name__}")


class Engine:
    """What ``deepspeed.initialize`` returns as its engine, for zeroshard.

    Call it to run the model's forward; ``backward(loss)`` scales (fp16) and
    accumulates; ``step()`` acts at accumulation boundaries.
    """

    def __init__(self, module: nn.Module, optimizer: ZeroOptimizer, config: Any) -> None:
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self._impl = _C.Engine(optimizer._impl, config)
        if torch.cuda.is_available() and any(p.is_cuda for p in module.parameters()):
            self._impl.set_device_peak_source(torch.cuda.max_memory_allocated)
        self._sync_lr()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs ``module(*args, **kwargs)``, timed as the forward."""
        self._impl.begin_forward()
        try:
            return self.module(*args, **kwargs)
        finally:
            self._impl.end_forward()

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` times the loss scale, divided by the accumulation steps."""
        self._impl.backward(loss)

    def step(self) -> bool:
        """Counts a micro-step; at a boundary updates the model. True if it did."""
        stepped = bool(self._impl.step())
        self._sync_lr()
        return stepped

    def _sync_lr(self) -> None:
        # The engine sets the learning rate in C++; mirror it so that
        # optimizer.param_groups shows what the step used.
        for group, lr in zip(self.optimizer.param_groups, self._impl.get_lr(), strict=True):
            group["lr"] = lr

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` ends an accumulation window."""
        return bool(self._impl.is_gradient_accumulation_boundary())

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped ones included, as DeepSpeed counts)."""
        return int(self._impl.global_steps)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank's gradients overflowed."""
        return int(self._impl.skipped_steps)

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return float(self._impl.loss_scale)

    def train_batch_size(self) -> int:
        """Global batch per optimizer step."""
        return int(self._impl.train_batch_size())

    def train_micro_batch_size_per_gpu(self) -> int:
        """Batch per rank per forward."""
        return int(self._impl.train_micro_batch_size_per_gpu())

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return int(self._impl.gradient_accumulation_steps())

    def get_lr(self) -> list[float]:
        """Learning rate of each parameter group."""
        return list(self._impl.get_lr())

    # Checkpoints ---------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        async_save: bool = False,
    ) -> str:
        """Collective: saves ``save_dir/<tag>`` (default ``global_step<N>``) and ``latest``.

        As DeepSpeed's ``save_checkpoint``, but loadable at any world size or
        stage, atomic (a crash leaves the previous checkpoint and ``latest``
        intact) and checksummed. Saves the optimizer state, the engine's
        counters, loss scaler and schedule position, the module's persistent
        buffers, every rank's RNG states and ``client_state`` (pickled).
        With ``async_save`` the state is copied to host memory during the call
        and a C++ thread writes and commits it while training goes on (the next
        save or load, ``wait_for_checkpoint()`` or exit waits for it).
        Returns the checkpoint's path.
        """
        self.optimizer._tensor_parallel.check_checkpointable()
        # What the next step uses (see ZeroOptimizer.save_checkpoint).
        self.optimizer._impl.set_hyperparameters(self.optimizer._hyperparameters())
        replicated_files = {"buffers.pt": _to_bytes(_persistent_buffers(self.module))}
        if client_state is not None:
            replicated_files["client_state.pt"] = _to_bytes(client_state)
        rank = self.optimizer._impl.checkpoint_rank()
        rank_files = {f"rng_state_{rank}.pt": _to_bytes(_python_rng_state())}
        path = str(
            self._impl.save_checkpoint(
                os.fspath(save_dir),
                tag or "",
                replicated_files,
                rank_files,
                save_latest,
                async_save,
            )
        )
        if async_save:
            _IN_FLIGHT.add(self.optimizer)
        return path

    def wait_for_checkpoint(self) -> None:
        """Waits for an asynchronous save; raises (on every rank) if it failed."""
        self.optimizer.wait_for_checkpoint()

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str, dict[str, Any] | None]:
        """Collective: loads ``load_dir/<tag>`` (default: what ``latest`` names).

        Works at any world size, stage, bucket size or offload setting.
        Returns ``(path, client_state)`` as DeepSpeed does. Raises
        ``ValueError`` on every rank, before anything changes, for another
        model (naming the first mismatched names and shapes), a corrupt file
        (naming the file and parameter) or a missing one.

        A DeepSpeed ZeRO checkpoint (``*_optim_states.pt`` files, no
        ``index.json``) loads too: rank 0 converts it into
        ``load_dir/<tag>.zeroshard`` (``zeroshard.deepspeed_migration``; kept,
        and reused while the DeepSpeed files are unchanged) and every rank
        loads that.
        """
        self.optimizer._tensor_parallel.check_checkpointable()
        tag = self._deepspeed_tag(load_dir, tag)
        loaded = self._impl.load_checkpoint(
            os.fspath(load_dir),
            tag or "",
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )
        self.optimizer._sync_hyperparameters()
        self._sync_lr()
        files = loaded["replicated_files"]
        if "buffers.pt" in files:
            _load_buffers(self.module, _from_bytes(files["buffers.pt"]))
        rank = self.optimizer._impl.checkpoint_rank()
        rng = loaded["rank_files"].get(f"rng_state_{rank}.pt")
        if rng is not None and not load_module_only:
            _set_python_rng_state(_from_bytes(rng))
        client_state = _from_bytes(files["client_state.pt"]) if "client_state.pt" in files else None
        return str(loaded["path"]), client_state

    def _deepspeed_tag(self, load_dir: str | os.PathLike[str], tag: str | None) -> str | None:
        """The tag to load: ``tag``, or its conversion if it names a DeepSpeed checkpoint.

        Collective when it does: rank 0 converts, then broadcasts its outcome,
        so the others load only a complete conversion and every rank raises if
        it failed (a barrier would leave them waiting on a rank 0 that raised).
        """
        root = Path(load_dir)
        name = tag or (_C.read_latest_tag(str(root)) if (root / "latest").exists() else None)
        if name is None or not deepspeed_migration.is_deepspeed_checkpoint(root / name):
            return tag
        source, converted = root / name, root / f"{name}.zeroshard"
        group = self.optimizer._process_group
        outcome: list[str | None] = [None]
        if dist.get_rank(group) == 0:
            try:
                if not deepspeed_migration.is_converted(source, converted):
                    deepspeed_migration.convert_deepspeed_checkpoint(source, converted)
            except Exception as error:  # noqa: BLE001 - raised below, on every rank
                outcome[0] = f"{type(error).__name__}: {error}"
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
        if outcome[0] is not None:
            raise ValueError(
                f"could not convert DeepSpeed checkpoint {source} into {converted} "
                f"(on rank 0): {outcome[0]}"
            )
        return converted.name

    def last_telemetry(self) -> dict[str, Any] | None:
        """The last telemetry record printed (every ``steps_per_print`` steps)."""
        return self._impl.last_telemetry()


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    # Written by this rank's own job (client_state may hold any picklable object).
    return torch.load(io.BytesIO(data), weights_only=False)


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict()`` holds (data-parallel ranks hold equal copies)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer.detach().cpu()
    return out


def _load_buffers(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    current = _persistent_buffers(module)
    missing = sorted(set(current) - set(saved))
    if missing:
        raise ValueError(f"the checkpoint has no value for buffer(s) {missing[:5]}")
    lookup = dict(module.named_buffers())
    with torch.no_grad():
        for name in current:
            lookup[name].copy_(saved[name])


def _python_rng_state() -> dict[str, Any]:
    # torch's CPU generator is saved by the C++ engine; these are the others.
    state: dict[str, Any] = {"python": random.getstate()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_python_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _ConfiguredScheduler:
    """The config's scheduler, as ``deepspeed.initialize`` returns it.

    The engine applies it at every step; ``step()`` here is a no-op so that
    loops written for DeepSpeed (which never call it) and loops that do both work.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def get_last_lr(self) -> list[float]:
        return self._engine.get_lr()

    def step(self, *args: Any, **kwargs: Any) -> None:
        """No-op: the engine steps the schedule at accumulation boundaries."""


def initialize(
    model: nn.Module,
    model_parameters: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
    config: str | os.PathLike | dict[str, Any] | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    mesh: Any = None,
    mpu: Any = None,
    unit_classes: Sequence[type[nn.Module]] = (),
    param_init_fn: Callable[[nn.Module], None] | None = None,
    check_collective_order: bool = True,
    memory_limit: float | str | None = None,
    sequence_length: int | None = None,
) -> tuple[Engine, ZeroOptimizer, None, _ConfiguredScheduler | None]:
    """Builds the engine, optimizer and scheduler a DeepSpeed config describes.

    Returns ``(engine, optimizer, None, lr_scheduler)`` as ``deepspeed.initialize``
    (the third item, a data loader, is not built). ``config`` is DeepSpeed's
    JSON as a path or a dict; errors name the key and what is expected.
    Stage 3 uses ``model`` for its hooks and ``unit_classes``, with the classes
    the config names in ``"zeroshard": {"unit_classes": [...]}``, as the wrap
    policy (see :func:`zeroshard.units.plan_units` for the default).

    ``"auto"`` as ``zero_optimization.stage`` or an offload section's
    ``device`` is resolved first from the estimator and the memory free on
    the ranks (see :func:`zeroshard.auto.resolve_auto`; ``memory_limit`` caps
    the memory per rank it plans for; ``sequence_length`` makes it count a
    transformer's activations too); rank 0 prints the decision and the
    figures behind it, and every rank raises ``ValueError`` naming what is
    short when nothing fits.

    The data-parallel ranks are ``process_group``'s, a ``mesh``'s (a 1-D
    ``DeviceMesh``, or 2-D (replicate, shard) for hybrid sharding), or
    DeepSpeed's ``mpu.get_data_parallel_group()``; the default group if none
    is given. ``zero_optimization.zero_hpz_partition_size`` > 1 splits them
    into shard groups of that many consecutive ranks, replicated across
    groups (hybrid sharding, see :mod:`zeroshard.groups`). The batch-size
    rule counts every data-parallel rank.
    """
    if config is None:
        raise ValueError("zeroshard.initialize needs config= (a DeepSpeed JSON path or dict)")
    groups = data_parallel_groups(process_group, mesh, None, mpu)
    parsed = _load_config(config, groups.world_size)
    if parsed.shard_group_size > 1:
        if groups.replicate is not None:
            raise ValueError(
                "zero_optimization.zero_hpz_partition_size splits the data-parallel group "
                "into shard groups; the mesh given is hybrid already. Use one of the two"
            )
        groups = hybrid_groups(parsed.shard_group_size, groups.shard)
        if dist.get_rank() == 0:
            size = parsed.shard_group_size
            print(
                f"[zeroshard] zero_hpz_partition_size={size} is read as hybrid sharding: "
                f"the whole model state is sharded over groups of {size} ranks and replicated "
                f"across {groups.world_size // size} groups (DeepSpeed's hpZ shards the "
                "optimizer state over every rank), so each rank holds "
                f"{groups.world_size // size}x DeepSpeed's optimizer state",
                flush=True,
            )
    elif groups.replicate is not None and parsed.has_auto_settings():
        raise ValueError(
            '"auto" with a hybrid (replicate, shard) mesh is not supported yet: use '
            "zero_optimization.zero_hpz_partition_size for the shard groups instead"
        )
    process_group = groups.shard
    if parsed.has_auto_settings():
        resolve_auto(parsed, model, process_group, memory_limit, sequence_length, groups.replicate)
    parsed.check_supported()
    arguments = parsed.optimizer_arguments()
    zero = dict(arguments["zero_options"])
    stage = zero.pop("stage")
    max_norm = zero.pop("max_norm")
    stage3: dict[str, Any] = {}
    if stage == 3:
        classes = tuple(unit_classes) + resolve_unit_classes(model, parsed.unit_classes)
        stage3 = {"unit_classes": classes, "param_init_fn": param_init_fn}
    elif parsed.unit_classes:
        raise ValueError(
            f"zeroshard.unit_classes is a stage 3 setting; zero_optimization.stage is {stage}"
        )
    params: Any = model_parameters if model_parameters is not None else model.parameters()
    hyperparameters = arguments["hyperparameters"]
    kind = arguments["optimizer"]
    if kind == "muon":  # two halves, as DeepSpeed's MuonWithAuxAdam
        params = muon_param_groups(model, params, hyperparameters)
        kind, hyperparameters = "adamw", {}
    optimizer = ZeroOptimizer(
        params,
        kind,
        stage,
        process_group,
        replicate_group=groups.replicate,
        module=model,
        max_norm=max_norm or None,
        check_collective_order=check_collective_order,
        **stage3,
        **zero,
        **hyperparameters,
    )
    engine = Engine(model, optimizer, parsed)
    scheduler = _ConfiguredScheduler(engine) if parsed.has_scheduler else None
    return engine, optimizer, None, scheduler
