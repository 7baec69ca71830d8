"""``zeroshard.initialize``: a DeepSpeed-style engine over the C++ core.

The config (a path or a dict, DeepSpeed's JSON) is parsed and validated in C++
(``csrc/config/deepspeed_config.cpp``); the engine's step logic (accumulation
boundaries, loss scaling, overflow skipping, LR schedule, telemetry) is the
C++ ``zeroshard::Engine``. This module only wires them to a Python model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import _C
from zeroshard.optimizer import ZeroOptimizer


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

    def last_telemetry(self) -> dict[str, Any] | None:
        """The last telemetry record printed (every ``steps_per_print`` steps)."""
        return self._impl.last_telemetry()


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
    unit_classes: Sequence[type[nn.Module]] = (),
    param_init_fn: Callable[[nn.Module], None] | None = None,
    check_collective_order: bool = True,
) -> tuple[Engine, ZeroOptimizer, None, _ConfiguredScheduler | None]:
    """Builds the engine, optimizer and scheduler a DeepSpeed config describes.

    Returns ``(engine, optimizer, None, lr_scheduler)`` as ``deepspeed.initialize``
    (the third item, a data loader, is not built). ``config`` is DeepSpeed's
    JSON as a path or a dict; errors name the key and what is expected.
    Stage 3 uses ``model`` for its hooks and ``unit_classes`` as the wrap policy.
    """
    if config is None:
        raise ValueError("zeroshard.initialize needs config= (a DeepSpeed JSON path or dict)")
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "zeroshard.initialize needs torch.distributed.init_process_group() first "
                "(torchrun sets up the environment for it) or process_group="
            )
        process_group = dist.group.WORLD
    world_size = dist.get_world_size(process_group)
    parsed = _load_config(config, world_size)
    parsed.check_supported()
    arguments = parsed.optimizer_arguments()
    zero = dict(arguments["zero_options"])
    stage = zero.pop("stage")
    max_norm = zero.pop("max_norm")
    stage3: dict[str, Any] = {}
    if stage == 3:
        stage3 = {"unit_classes": unit_classes, "param_init_fn": param_init_fn}
    optimizer = ZeroOptimizer(
        model_parameters if model_parameters is not None else model.parameters(),
        arguments["optimizer"],
        stage,
        process_group,
        module=model,
        max_norm=max_norm or None,
        check_collective_order=check_collective_order,
        **stage3,
        **zero,
        **arguments["hyperparameters"],
    )
    engine = Engine(model, optimizer, parsed)
    scheduler = _ConfiguredScheduler(engine) if parsed.has_scheduler else None
    return engine, optimizer, None, scheduler
