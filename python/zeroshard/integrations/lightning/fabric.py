"""zeroshard under Lightning Fabric: ``ZeroShardStrategy`` for ``lightning.fabric.Fabric``.

    from zeroshard.integrations.lightning.fabric import ZeroShardStrategy
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ZeroShardStrategy(stage=2))
    fabric.launch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    with fabric.no_backward_sync(model, enabled=micro_step):   # accumulation
        fabric.backward(model(x).loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)     # zeroshard's global norm
    optimizer.step(); scheduler.step(); optimizer.zero_grad()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": step})
    fabric.load("ckpt", state)                                  # any world size

``fabric.setup`` turns the torch.optim AdamW, Adam or SGD into a
``zeroshard.ZeroOptimizer`` with the same groups and hyper-parameters (the
object Fabric returns wraps it) and points ``scheduler=`` at it; the model
gets no DDP wrapper. Give every scheduler to ``setup`` (one built on the
torch optimizer and not given still changes the right learning rates: the
torch optimizer's ``param_groups`` become the ZeroOptimizer's). Set up the
model and its optimizer together, once. ``fabric.save`` writes a directory:
``zeroshard/`` (the weights and optimizer state, every rank's shard) and
``lightning.pt`` (the rest of ``state``, with the model's buffers);
``fabric.load`` restores it at any world size or stage. Precision
``"32-true"``, ``"bf16-mixed"`` / ``"16-mixed"`` (autocast over fp32
weights), ``"bf16-true"`` / ``"16-true"`` (the model in 16 bits, fp32 master
weights in the ZeroOptimizer); fp16 with zeroshard's dynamic loss scaling.
Also registered in Fabric's registry as ``zeroshard_stage_1`` ...
``zeroshard_stage_3_offload``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from zeroshard.integrations.lightning._shared import (
    HALF_DTYPES,
    LIGHTNING_STATE_FILE,
    LOSS_SCALED,
    OPTIMIZER_MARKER,
    REGISTERED,
    ZEROSHARD_SUBDIR,
    DynamicLossScale,
    ZeroArguments,
    buffers_to_device,
    check_checkpoint_directory,
    check_precision,
    first_meta_parameter,
    load_buffers,
    persistent_buffers,
    retarget_scheduler,
    strategy_config,
    write_checkpoint_directory,
    zero_optimizer_from,
)
from zeroshard.optimizer import ZeroOptimizer

# isort: split
# After _shared, which checks the lightning version.
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH

_MODEL_KEY_MARKER = "zeroshard_model"


class ZeroShardFabricPrecision(MixedPrecision):
    """Fabric's precision under zeroshard: autocast over fp32 weights for
    ``"bf16-mixed"`` / ``"16-mixed"``, the model in 16 bits with fp32 master
    weights in the ZeroOptimizer for ``"bf16-true"`` / ``"16-true"``, and
    zeroshard's dynamic loss scaling for fp16 (torch's GradScaler reads
    ``.grad``, which stages 2-3 free)."""

    def __init__(self, precision: str, device: str = "cpu") -> None:
        check_precision(precision, "ZeroShardStrategy")
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self.scaler = None
        self._desired_input_dtype = {
            "bf16-mixed": torch.bfloat16,
            "16-mixed": torch.float16,
            **HALF_DTYPES,
        }.get(precision, torch.float32)
        self.loss_scale = DynamicLossScale() if precision in LOSS_SCALED else None
        self._half = HalfPrecision(precision) if precision in HALF_DTYPES else None  # type: ignore[arg-type]

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The model in 16 bits for the "-true" precisions."""
        return self._half.convert_module(module) if self._half is not None else module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """16-bit default dtype for the "-true" precisions."""
        if self._half is not None:
            return self._half.tensor_init_context()
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """As ``tensor_init_context``."""
        return self.tensor_init_context()

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast ("-mixed"), a 16-bit default dtype ("-true") or nothing."""
        if self._half is not None:
            return self._half.forward_context()
        if self.precision == "32-true":
            return contextlib.nullcontext()
        return super().forward_context()

    def convert_input(self, data: Any) -> Any:
        """As MixedPrecision / HalfPrecision; "32-true" leaves the inputs alone."""
        if self._half is not None:
            return self._half.convert_input(data)
        return data if self.precision == "32-true" else super().convert_input(data)

    def convert_output(self, data: Any) -> Any:
        """As MixedPrecision / HalfPrecision; "32-true" leaves the outputs alone."""
        if self._half is not None:
            return self._half.convert_output(data)
        return data if self.precision == "32-true" else super().convert_output(data)

    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        """Backward of the loss times the fp16 loss scale."""
        if self.loss_scale is not None:
            tensor = tensor * self.loss_scale.scale
        Precision.backward(self, tensor, model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """zeroshard's step; with fp16, then the loss scale's update."""
        zero = _zero(optimizer)
        output = zero.step(**kwargs)
        if self.loss_scale is not None:
            self.loss_scale.update(zero.last_step_skipped())
            zero._impl.set_loss_scale(self.loss_scale.scale)
        return output

    def unscale_gradients(self, optimizer: Any) -> None:
        """Nothing: zeroshard divides by the loss scale itself."""

    def state_dict(self) -> dict[str, Any]:
        """The loss scale's state (fp16), else empty."""
        return self.loss_scale.state_dict() if self.loss_scale is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores ``state_dict()``."""
        if self.loss_scale is not None and state_dict:
            self.loss_scale.load_state_dict(state_dict)


def _zero(optimizer: Any) -> ZeroOptimizer:
    # Fabric's wrapper first: it passes isinstance checks for the class it wraps.
    inner = getattr(optimizer, "_optimizer", optimizer)
    if not isinstance(inner, ZeroOptimizer):
        raise TypeError(
            "ZeroShardStrategy expected the zeroshard.ZeroOptimizer fabric.setup returned, got "
            f"{type(inner).__name__}"
        )
    return inner


def _converted_precision(plugin: Precision | None) -> ZeroShardFabricPrecision | None:
    if plugin is None or isinstance(plugin, ZeroShardFabricPrecision):
        return plugin
    if type(plugin) is Precision:
        return ZeroShardFabricPrecision("32-true")
    if type(plugin) is MixedPrecision and plugin.precision in ("bf16-mixed", "16-mixed"):
        return ZeroShardFabricPrecision(plugin.precision, plugin.device)
    if type(plugin) is HalfPrecision:
        return ZeroShardFabricPrecision(plugin.precision)
    check_precision(str(getattr(plugin, "precision", type(plugin).__name__)), "ZeroShardStrategy")
    raise ValueError(
        f"ZeroShardStrategy does not support the precision plugin {type(plugin).__name__}; "
        "pass precision='32-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true' to Fabric"
    )


class _ZeroShardBackwardSyncControl(_BackwardSyncControl):
    def __init__(self, strategy: ZeroShardStrategy) -> None:
        self._strategy = strategy

    def no_backward_sync(
        self, module: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager:
        zero = self._strategy.zero_optimizer
        if not enabled or zero is None:
            return contextlib.nullcontext()
        return zero.no_sync()


class ZeroShardStrategy(DDPStrategy):
    """ZeRO stages 1-3 (and offload) for ``lightning.fabric.Fabric``; see the module docstring.

    The arguments are those of the Trainer's
    :class:`zeroshard.integrations.lightning.ZeroShardStrategy`; the config
    must not set ``gradient_accumulation_steps`` or ``gradient_clipping``
    (the loop does both: ``no_backward_sync``, ``clip_gradients``).
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        pin_memory: bool = False,
        reduce_bucket_size: int | None = None,
        sub_group_size: int | None = None,
        unit_classes: Sequence[type[nn.Module]] = (),
        param_init_fn: Callable[[nn.Module], None] | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.config = strategy_config(
            config,
            stage,
            offload_optimizer,
            offload_parameters,
            pin_memory,
            reduce_bucket_size,
            sub_group_size,
        )
        self.unit_classes = tuple(unit_classes)
        self.param_init_fn = param_init_fn
        self.zero_optimizer: ZeroOptimizer | None = None
        self._module: nn.Module | None = None
        self._backward_sync_control = _ZeroShardBackwardSyncControl(self)

    @property
    def precision(self) -> Precision:
        """The precision plugin: always a :class:`ZeroShardFabricPrecision`."""
        plugin = self._precision
        return plugin if plugin is not None else ZeroShardFabricPrecision("32-true")

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        self._precision = _converted_precision(plugin)

    # Setup -------------------------------------------------------------------

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        """Collective: the model (no DDP) and its ZeroOptimizer; ``scheduler`` follows it."""
        if self.zero_optimizer is not None:
            raise RuntimeError(
                "ZeroShardStrategy sets up one model and its optimizer, once; fabric.setup was "
                "called again"
            )
        if len(optimizers) != 1:
            raise ValueError(
                f"ZeroShardStrategy needs exactly one optimizer per model, got {len(optimizers)}"
            )
        arguments = ZeroArguments(
            self.config, self.world_size, self.precision.precision, None, None
        )
        original = optimizers[0]
        if first_meta_parameter(module) is not None:
            buffers_to_device(module, self.root_device)
        zero = zero_optimizer_from(
            original, module, arguments, self.unit_classes, self.param_init_fn, self.root_device
        )
        if scheduler is not None and zero is not original:
            retarget_scheduler(scheduler, original, zero)
        plugin = self.precision
        if isinstance(plugin, ZeroShardFabricPrecision) and arguments.loss_scale is not None:
            plugin.loss_scale = arguments.loss_scale  # the config's fp16 section
        if self.precision.loss_scale is not None:  # type: ignore[attr-defined]
            zero._impl.set_loss_scale(self.precision.loss_scale.scale)  # type: ignore[attr-defined]
        self.zero_optimizer = zero
        self._module = module
        return module, [zero], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """A model without an optimizer (evaluation): no DDP wrapper."""
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Refused: the model and its optimizer are set up together."""
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def module_to_device(self, module: nn.Module) -> None:
        """Moves the model (before its ZeroOptimizer is built: afterwards it stays)."""
        if first_meta_parameter(module) is not None:
            return  # built by init_module() at stage 3: the ZeroOptimizer materializes it
        if self.zero_optimizer is None or module is not self._module:
            module.to(self.root_device)

    @contextlib.contextmanager
    def module_sharded_context(self) -> Any:
        """Stage 3: ``fabric.init_module()`` builds on the meta device; the
        ZeroOptimizer materializes the model partitioned."""
        if int((self.config.get("zero_optimization") or {}).get("stage", 0)) == 3:
            with torch.device("meta"):
                yield
        else:
            yield

    def module_init_context(
        self, empty_init: bool | None = None
    ) -> contextlib.AbstractContextManager:
        """At stage 3 the meta device (see ``module_sharded_context``)."""
        if int((self.config.get("zero_optimization") or {}).get("stage", 0)) == 3:
            return self.module_sharded_context()
        return super().module_init_context(empty_init)

    # Gradients -----------------------------------------------------------------

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Any,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Collective: clips by zeroshard's global L2 norm; returns the norm."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"ZeroShardStrategy clips by the global L2 norm; norm_type={norm_type} is not "
                "supported"
            )
        zero = _zero(optimizer)
        norm = zero.clip_grad_norm_(float(max_norm))
        if error_if_nonfinite and not torch.isfinite(norm) and not zero._skip_nonfinite_steps:
            raise RuntimeError(
                f"The total norm of the gradients is non-finite ({norm.item()}), so they cannot "
                "be clipped (the norm is global: every rank raises). Pass "
                "error_if_nonfinite=False to clip anyway"
            )
        return norm

    def clip_gradients_value(
        self, module: nn.Module, optimizer: Any, clip_val: float | int
    ) -> None:
        """Refused: the gradients are sharded; clip by norm."""
        raise ValueError(
            "ZeroShardStrategy clips by the global norm only: fabric.clip_gradients(clip_val=...) "
            "is not supported (the gradients are sharded); use max_norm="
        )

    # Checkpoints -------------------------------------------------------------

    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Collective: ``path`` as a checkpoint directory (see the module docstring)."""
        zero = self.zero_optimizer
        if zero is None:
            super().save_checkpoint(path, state, storage_options, filter)
            return
        if storage_options is not None or filter:
            raise TypeError(
                "ZeroShardStrategy writes its checkpoints itself: storage_options and filter "
                "are not supported"
            )
        rest: dict[str, Any] = {}
        for key, value in state.items():
            if value is zero:
                rest[key] = dict(OPTIMIZER_MARKER)
            elif value is self._module:
                rest[key] = {_MODEL_KEY_MARKER: persistent_buffers(value)}
            elif isinstance(value, (nn.Module, torch.optim.Optimizer)):
                raise ValueError(
                    f"ZeroShardStrategy saves the model and optimizer fabric.setup returned; "
                    f"state[{key!r}] is another {type(value).__name__}"
                )
            elif hasattr(value, "state_dict") and callable(value.state_dict):
                rest[key] = value.state_dict()
            else:
                rest[key] = value
        write_checkpoint_directory(self, path, zero, rest)

    def load_checkpoint(
        self,
        path: _PATH,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Collective: restores ``state`` (model, optimizer, the rest) from a checkpoint
        directory at any world size or stage; returns what ``state`` did not take."""
        zero = self.zero_optimizer
        if zero is None:
            return super().load_checkpoint(path, state, strict, weights_only)
        root = check_checkpoint_directory(path)
        # Written by this strategy: the rest of `state` may hold any object.
        saved: dict[str, Any] = torch.load(root / LIGHTNING_STATE_FILE, weights_only=False)
        if not isinstance(state, dict) or not state:
            raise ValueError(
                "ZeroShardStrategy.load needs the state dict the checkpoint was saved from, "
                "holding the model and optimizer fabric.setup returned"
            )
        wants_optimizer = any(value is zero for value in state.values())
        zero.load_checkpoint(root / ZEROSHARD_SUBDIR, load_optimizer_states=wants_optimizer)
        missing = sorted(set(state) - set(saved))
        if missing and strict:
            raise KeyError(f"the checkpoint {root} has no {missing}")
        for key, value in list(state.items()):
            if key not in saved:
                continue
            stored = saved.pop(key)
            if value is zero:
                if stored != OPTIMIZER_MARKER:
                    raise ValueError(f"state[{key!r}] in {root} is not this strategy's optimizer")
            elif value is self._module:
                load_buffers(value, stored.get(_MODEL_KEY_MARKER, {}), strict)
            elif hasattr(value, "load_state_dict") and callable(value.load_state_dict):
                value.load_state_dict(stored)
            else:
                state[key] = stored
        return saved

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``zeroshard_stage_1`` ... ``zeroshard_stage_3_offload``."""
        for name, description, kwargs in REGISTERED:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)


def _register() -> None:
    ZeroShardStrategy.register_strategies(STRATEGY_REGISTRY)


_register()

__all__ = ["ZeroShardFabricPrecision", "ZeroShardStrategy"]
