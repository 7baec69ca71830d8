"""zeroshard under Lightning: ``ZeroShardStrategy`` for ``lightning.pytorch.Trainer``.

    import zeroshard.integrations.lightning  # registers the names below
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zeroshard_stage_2",
                      accumulate_grad_batches=2, gradient_clip_val=1.0, precision="bf16-mixed")
    trainer.fit(model)                      # ckpt_path= resumes at any world size
    # or: Trainer(strategy=ZeroShardStrategy(config="ds_config.json"))

Registered names: ``zeroshard_stage_1``, ``zeroshard_stage_2``,
``zeroshard_stage_2_offload``, ``zeroshard_stage_3``,
``zeroshard_stage_3_offload`` (CPU offload of the optimizer state, and at
stage 3 of the parameters). For Fabric see
:mod:`zeroshard.integrations.lightning.fabric` (registered under the same
names in Fabric's registry).

What it changes from Lightning's DDP strategy:

- The optimizer ``configure_optimizers`` returns (torch.optim AdamW, Adam or
  SGD; one) becomes a ``zeroshard.ZeroOptimizer`` with the same parameter
  groups and hyper-parameters; its LR scheduler is pointed at it. No DDP
  wrapper: zeroshard reduces the gradients.
- ``accumulate_grad_batches`` micro-steps run under the optimizer's
  ``no_sync()``; ``gradient_clip_val`` clips by zeroshard's global norm
  (clipping by value is refused).
- ``precision``: ``"32-true"``; ``"bf16-mixed"`` and ``"16-mixed"``
  (autocast over the fp32 weights, as Lightning's AMP); ``"bf16-true"`` and
  ``"16-true"`` (the model in 16 bits, fp32 master weights in the
  ZeroOptimizer: zeroshard's and DeepSpeed's mixed precision). fp16 uses
  zeroshard's dynamic loss scaling: a step whose gradients overflow on any
  rank is skipped on every rank. Anything else is refused naming it.
- Stage 3 gathers the model's units around their forward, and runs the
  LightningModule's steps as its forward (so the parameters it owns directly
  are gathered for them); a ``configure_model`` hook builds its layers on
  the meta device and the ZeroOptimizer materializes them partitioned (each
  rank allocates its shards only), initialized by ``reset_parameters`` (or
  ``param_init_fn``): values written in ``configure_model`` are not kept.
- ``trainer.save_checkpoint`` / ``ModelCheckpoint`` write a directory (as
  DeepSpeedStrategy does): ``zeroshard/`` (every rank's shard of the weights
  and optimizer state) and ``lightning.pt`` (Lightning's own state: loops,
  schedulers, callbacks, hyper-parameters, buffers). ``ckpt_path=`` resumes
  from it at any world size or stage; :func:`convert_to_lightning_checkpoint`
  makes a plain ``.ckpt`` of it, ``python -m zeroshard consolidate
  <dir>/zeroshard out`` safetensors of the parameters (the buffers are in
  ``lightning.pt``).

Supported: lightning 2.6 (``pip install 'zeroshard[lightning]'``; tested with
2.6.6). Importing this module with another version raises ImportError naming it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint import consolidated_state_dict
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
    materialize_without_optimizer,
    persistent_buffers,
    retarget_scheduler,
    strategy_config,
    write_checkpoint_directory,
    zero_optimizer_from,
)
from zeroshard.optimizer import ZeroOptimizer

# isort: split
# After _shared, which checks the lightning version.
import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType


class ZeroShardPrecision(MixedPrecision):
    """The precision plugin ``ZeroShardStrategy`` puts in place of Lightning's.

    ``"bf16-mixed"`` / ``"16-mixed"`` run the forward under autocast over the
    fp32 weights (as Lightning's ``MixedPrecision``); ``"bf16-true"`` /
    ``"16-true"`` turn the model into 16 bits (as Lightning's
    ``HalfPrecision``) and the ZeroOptimizer keeps fp32 master weights;
    ``"32-true"`` changes nothing. fp16 scales the loss with
    :class:`DynamicLossScale` instead of torch's ``GradScaler`` (which reads
    ``.grad``, freed at stages 2-3). Clipping by norm uses zeroshard's global
    norm.
    """

    def __init__(self, precision: str, device: str = "cpu") -> None:
        check_precision(precision, "ZeroShardStrategy")
        # Not MixedPrecision.__init__: it accepts 16-bit precisions only and
        # builds a GradScaler for "16-mixed".
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self.scaler = None
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

    def convert_input(self, data: Any) -> Any:
        """Floating-point inputs in 16 bits for the "-true" precisions."""
        return self._half.convert_input(data) if self._half is not None else data

    def forward_context(self) -> contextlib.AbstractContextManager:  # type: ignore[override]
        """Autocast ("-mixed"), a 16-bit default dtype ("-true") or nothing."""
        if self._half is not None:
            return self._half.forward_context()
        if self.precision == "32-true":
            return contextlib.nullcontext()
        return self.autocast_context_manager()

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        """Multiplies the loss by the fp16 loss scale."""
        if self.loss_scale is not None:
            tensor = tensor * self.loss_scale.scale
        return Precision.pre_backward(self, tensor, module)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """The closure (backward), the hooks and clipping, then zeroshard's step."""
        zero = _zero(optimizer)
        if self.loss_scale is not None:
            zero._impl.set_loss_scale(self.loss_scale.scale)
        result = closure()
        self._after_closure(model, optimizer)
        zero.step(**kwargs)
        if self.loss_scale is not None:
            self.loss_scale.update(zero.last_step_skipped())
        return result

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clips by zeroshard's global norm (by value is refused)."""
        if clip_val is None or clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                "ZeroShardStrategy clips by the global norm only: gradient_clip_algorithm='value' "
                "is not supported (the gradients are sharded); use gradient_clip_algorithm='norm'"
            )
        _zero(optimizer).clip_grad_norm_(float(clip_val))

    def state_dict(self) -> dict[str, Any]:
        """The loss scale's state (fp16), else empty."""
        return self.loss_scale.state_dict() if self.loss_scale is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores ``state_dict()``."""
        if self.loss_scale is not None and state_dict:
            self.loss_scale.load_state_dict(state_dict)


def _zero(optimizer: Any) -> ZeroOptimizer:
    inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    if not isinstance(inner, ZeroOptimizer):
        raise TypeError(
            f"ZeroShardStrategy expected its zeroshard.ZeroOptimizer, got {type(inner).__name__}"
        )
    return inner


def _converted_precision(plugin: Precision | None) -> ZeroShardPrecision | None:
    if plugin is None or isinstance(plugin, ZeroShardPrecision):
        return plugin
    if type(plugin) is Precision:
        return ZeroShardPrecision("32-true")
    if type(plugin) is MixedPrecision and plugin.precision in ("bf16-mixed", "16-mixed"):
        return ZeroShardPrecision(plugin.precision, plugin.device)
    if type(plugin) is HalfPrecision:
        return ZeroShardPrecision(plugin.precision)
    check_precision(str(getattr(plugin, "precision", type(plugin).__name__)), "ZeroShardStrategy")
    raise ValueError(
        f"ZeroShardStrategy does not support the precision plugin {type(plugin).__name__}; "
        "pass precision='32-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true' to the "
        "Trainer"
    )


class ZeroShardStrategy(DDPStrategy):
    """ZeRO stages 1-3 (and offload) for ``lightning.pytorch.Trainer``; see the module docstring.

    Args:
        config: DeepSpeed's JSON config (a path or a dict): its
            ``zero_optimization`` section and zeroshard's keys. When given, the
            keyword arguments below that describe it (``stage``, offload,
            buckets) are ignored, as in DeepSpeedStrategy. It must not hold an
            optimizer or scheduler section (they come from
            ``configure_optimizers``); batch sizes are the DataLoader's; a
            ``gradient_accumulation_steps`` or ``gradient_clipping`` value
            must agree with the Trainer's.
        stage: the ZeRO stage, 1, 2 or 3.
        offload_optimizer: keep the optimizer state in CPU memory.
        offload_parameters: stage 3: keep the parameter shards in CPU memory.
        pin_memory: pin the offloaded memory.
        reduce_bucket_size / sub_group_size: DeepSpeed's keys of the same name.
        unit_classes: stage 3: module classes gathered as one unit.
        param_init_fn: stage 3 with a meta-built model: initializes one
            module's direct parameters (default ``reset_parameters()``).
        Other arguments are DDPStrategy's (``process_group_backend``,
        ``timeout``, ...).
    """

    strategy_name = "zeroshard"

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
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
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

    @property
    def stage(self) -> int:
        """The ZeRO stage of the config."""
        return int((self.config.get("zero_optimization") or {}).get("stage", 0))

    # Precision ---------------------------------------------------------------

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        """The precision plugin: always a :class:`ZeroShardPrecision`."""
        plugin = self._precision_plugin
        return plugin if plugin is not None else ZeroShardPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = _converted_precision(plugin)

    # Setup -------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        """The accelerator, the model on its device, and (fitting) the ZeroOptimizer."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        if getattr(self, "_layer_sync", None) is not None:
            raise ValueError("ZeroShardStrategy does not support sync_batchnorm=True yet")
        if self.zero_optimizer is None:
            self.model = self.precision_plugin.convert_module(self.model)
        meta = first_meta_parameter(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if meta is None:
            self.model_to_device()
        elif not fitting:
            materialize_without_optimizer(self.model, self.root_device)
        elif self.stage != 3:
            raise ValueError(
                f"parameter {meta!r} is on the meta device: partitioned construction "
                f"(configure_model under ZeroShardStrategy) is stage 3's; the stage is {self.stage}"
            )
        else:
            buffers_to_device(self.model, self.root_device)
        if fitting:
            if self.zero_optimizer is not None:
                # The parameters are views of (at stage 3, shards in) the first
                # ZeroOptimizer's buffers: another could not take them over.
                raise RuntimeError(
                    "ZeroShardStrategy trains a model once: a second fit with the same strategy "
                    "is not supported. Save a checkpoint and resume it with a new Trainer, a new "
                    "strategy and a new model: fit(model, ckpt_path=...)"
                )
            self.setup_optimizers(trainer)
            self._build_zero_optimizer(trainer)
        self.setup_precision_plugin()

    def _build_zero_optimizer(self, trainer: pl.Trainer) -> None:
        optimizers = self.optimizers
        if len(optimizers) != 1 or type(optimizers[0]).__name__ == "_MockOptimizer":
            raise ValueError(
                "ZeroShardStrategy needs exactly one optimizer from configure_optimizers, got "
                f"{[type(o).__name__ for o in optimizers]}"
            )
        module = self.lightning_module
        assert module is not None
        arguments = ZeroArguments(
            self.config,
            self.world_size,
            self.precision_plugin.precision,
            trainer.accumulate_grad_batches,
            trainer.gradient_clip_val if module.automatic_optimization else None,
        )
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE and (
            trainer.gradient_clip_val or 0
        ):
            raise ValueError(
                "ZeroShardStrategy clips by the global norm only: gradient_clip_algorithm='value' "
                "is not supported (the gradients are sharded); use gradient_clip_algorithm='norm'"
            )
        plugin = self.precision_plugin
        if isinstance(plugin, ZeroShardPrecision) and arguments.loss_scale is not None:
            plugin.loss_scale = arguments.loss_scale  # the config's fp16 section
        original = optimizers[0]
        zero = zero_optimizer_from(
            original, module, arguments, self.unit_classes, self.param_init_fn, self.root_device
        )
        for config in self.lr_scheduler_configs:
            if zero is not original:
                retarget_scheduler(config.scheduler, original, zero)
        self.zero_optimizer = zero
        self.optimizers = [zero]

    def _setup_model(self, model: nn.Module) -> nn.Module:
        # No DistributedDataParallel: zeroshard reduces the gradients.
        return model

    def configure_ddp(self) -> None:
        """Nothing to wrap (no DistributedDataParallel)."""

    def model_to_device(self) -> None:
        """Moves the model to the device (before the ZeroOptimizer takes its parameters)."""
        assert self.model is not None
        if self.zero_optimizer is None:
            self.model.to(self.root_device)

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: ``configure_model`` builds on the meta device (partitioned construction)."""
        if self.stage == 3:
            with torch.device("meta"):
                yield
        else:
            yield

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps: backward without communication (``no_sync``)."""
        if self.zero_optimizer is None:
            yield
            return
        with self.zero_optimizer.no_sync():
            yield

    # Steps at stage 3 --------------------------------------------------------

    def _step_as_forward(self, method: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        # Lightning calls the LightningModule's steps, not its forward: at
        # stage 3 the step runs as its forward, so that the model's hooks run
        # around it (parameters the LightningModule owns directly are a unit
        # gathered for the step; the ranks agree at its end).
        module = self.lightning_module
        assert module is not None
        with context:
            if self.zero_optimizer is None or self.stage != 3:
                return getattr(module, method)(*args, **kwargs)
            return self._forward_redirection(module, module, method, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``training_step`` (at stage 3 run as its forward)."""
        return self._step_as_forward(
            "training_step", self.precision_plugin.train_step_context(), *args, **kwargs
        )

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``validation_step`` (at stage 3 run as its forward)."""
        return self._step_as_forward(
            "validation_step", self.precision_plugin.val_step_context(), *args, **kwargs
        )

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``test_step`` (at stage 3 run as its forward)."""
        return self._step_as_forward(
            "test_step", self.precision_plugin.test_step_context(), *args, **kwargs
        )

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``predict_step`` (at stage 3 run as its forward)."""
        return self._step_as_forward(
            "predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs
        )

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the ZeroOptimizer, so after it is built."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The ZeroOptimizer's state comes from the zeroshard checkpoint."""
        return False

    def teardown(self) -> None:
        """Releases the plugins; the model stays where it is (its parameters are
        views of the ZeroOptimizer's buffers, which a move would detach)."""
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    # Checkpoints -------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The buffers (the weights are in the zeroshard checkpoint; at stage 3 a
        rank holds only its shard of them)."""
        if self.zero_optimizer is None:
            return super().lightning_module_state_dict()
        assert self.lightning_module is not None
        return persistent_buffers(self.lightning_module)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """A marker: the optimizer's state is in the zeroshard checkpoint."""
        if self.zero_optimizer is None:
            return super().optimizer_state(optimizer)
        return dict(OPTIMIZER_MARKER)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Collective: the checkpoint directory ``filepath`` (see the module docstring)."""
        if self.zero_optimizer is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                "ZeroShardStrategy writes its checkpoints itself: storage_options is not supported"
            )
        state = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
        state["optimizer_states"] = [dict(OPTIMIZER_MARKER)]
        write_checkpoint_directory(self, filepath, self.zero_optimizer, state)

    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Collective: loads a checkpoint directory (any world size or stage).

        Fitting restores the weights and the optimizer state into the
        ZeroOptimizer; otherwise (validate, test, predict) the full weights
        are loaded into the model. Returns Lightning's state.
        """
        root = check_checkpoint_directory(checkpoint_path)
        # Written by this strategy (Lightning's state: hyper-parameters may be any object).
        checkpoint = torch.load(root / LIGHTNING_STATE_FILE, weights_only=False)
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        if self.zero_optimizer is not None:
            self.zero_optimizer.load_checkpoint(
                root / ZEROSHARD_SUBDIR, load_optimizer_states=fitting
            )
        else:
            full = consolidated_state_dict(root / ZEROSHARD_SUBDIR)
            names = dict(module.named_parameters(remove_duplicate=False))
            missing = sorted(set(names) - set(full))
            if missing:
                raise ValueError(
                    f"checkpoint {root} holds no weights for {len(missing)} parameters of the "
                    f"model, first {missing[:5]}"
                )
            with torch.no_grad():
                for name, param in names.items():
                    param.copy_(full[name])
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The buffers (the weights were loaded with the zeroshard checkpoint)."""
        assert self.lightning_module is not None
        load_buffers(self.lightning_module, checkpoint.get("state_dict", {}), strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: the ZeroOptimizer's state was loaded with the zeroshard checkpoint."""

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Removes a checkpoint directory (rank 0, after every rank wrote it)."""
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``zeroshard_stage_1`` ... ``zeroshard_stage_3_offload``."""
        for name, description, kwargs in REGISTERED:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)


ZeroShardStrategy.register_strategies(StrategyRegistry)


def convert_to_lightning_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str],
    dtype: str | torch.dtype | None = None,
) -> dict[str, Any]:
    """A ZeroShardStrategy checkpoint directory as one plain Lightning ``.ckpt`` file.

    The file holds Lightning's state with the full weights in ``state_dict``
    (gathered from every rank's shard, one parameter at a time; ``dtype``
    defaults to each parameter's training dtype) and no optimizer state, so
    ``LightningModule.load_from_checkpoint(output_file)`` and
    ``Trainer(...).validate(model, ckpt_path=output_file)`` with any strategy
    load it. Runs on one process, no process group. Returns the dictionary
    written. For safetensors of the parameters run ``python -m zeroshard
    consolidate <checkpoint_dir>/zeroshard out``.
    """
    root = check_checkpoint_directory(checkpoint_dir)
    state = torch.load(root / LIGHTNING_STATE_FILE, weights_only=False)
    weights = consolidated_state_dict(root / ZEROSHARD_SUBDIR, dtype=dtype)
    state["state_dict"] = {**weights, **state.get("state_dict", {})}  # + the buffers
    state.pop("optimizer_states", None)
    torch.save(state, output_file)
    return state


from zeroshard.integrations.lightning import fabric  # noqa: E402,F401 - registers Fabric's names

__all__ = [
    "ZeroShardPrecision",
    "ZeroShardStrategy",
    "convert_to_lightning_checkpoint",
]
