"""What the Lightning Trainer and Fabric strategies share: the supported
lightning versions, the config, the ZeroOptimizer built from a torch.optim
optimizer, fp16 loss scaling, and the checkpoint directory's layout."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard import _C
from zeroshard.optimizer import ZeroOptimizer
from zeroshard.units import resolve_unit_classes

try:
    import lightning
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "zeroshard.integrations.lightning needs lightning: pip install 'zeroshard[lightning]' "
        "(or 'lightning>=2.6,<2.7')"
    ) from error

# The range setup.py's `lightning` extra pins and the tests run (2.6.6): the
# strategies override hooks of Lightning's DDP strategy whose signatures are
# not a public API across minor versions.
SUPPORTED_LIGHTNING = ((2, 6), (2, 7))
SUPPORTED_LIGHTNING_TEXT = "lightning>=2.6,<2.7"


def check_lightning_version(version: str | None = None) -> None:
    """Raises ImportError naming the installed lightning if it is not supported."""
    version = version if version is not None else lightning.__version__
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = (0, 0)
    low, high = SUPPORTED_LIGHTNING
    if not (low <= major_minor < high):
        raise ImportError(
            f"zeroshard.integrations.lightning supports {SUPPORTED_LIGHTNING_TEXT}; lightning "
            f"{version} is installed. Install a supported version: pip install "
            f"'{SUPPORTED_LIGHTNING_TEXT}'"
        )


check_lightning_version()

# A checkpoint directory: the zeroshard checkpoint (every rank's shard) and
# Lightning's own state (loops, schedulers, callbacks, hyper-parameters,
# buffers) beside it.
ZEROSHARD_SUBDIR = "zeroshard"
LIGHTNING_STATE_FILE = "lightning.pt"
# What stands in for the optimizer's state in Lightning's dictionary.
OPTIMIZER_MARKER = {"zeroshard": f"the optimizer state is in {ZEROSHARD_SUBDIR}/"}

# "-mixed": autocast over fp32 weights (Lightning's AMP); "-true": the model
# in 16 bits and fp32 master weights in the ZeroOptimizer (zeroshard's, and
# DeepSpeed's, mixed precision).
_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
HALF_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
# The precisions whose loss is scaled (fp16's narrow range).
LOSS_SCALED = ("16-mixed", "16-true")

# The names both registries (Trainer's and Fabric's) get: (name, description, arguments).
REGISTERED: list[tuple[str, str, dict[str, Any]]] = [
    ("zeroshard_stage_1", "zeroshard ZeRO stage 1", {"stage": 1}),
    ("zeroshard_stage_2", "zeroshard ZeRO stage 2", {"stage": 2}),
    (
        "zeroshard_stage_2_offload",
        "zeroshard ZeRO stage 2, optimizer state in CPU memory",
        {"stage": 2, "offload_optimizer": True},
    ),
    ("zeroshard_stage_3", "zeroshard ZeRO stage 3", {"stage": 3}),
    (
        "zeroshard_stage_3_offload",
        "zeroshard ZeRO stage 3, optimizer state and parameters in CPU memory",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
]


def check_precision(precision: str, where: str) -> None:
    """Raises ValueError for a precision the strategies do not map."""
    if precision not in _PRECISIONS:
        raise ValueError(f"{where} supports precision {list(_PRECISIONS)}, got {precision!r}")


def default_config(
    stage: int,
    offload_optimizer: bool,
    offload_parameters: bool,
    pin_memory: bool,
    reduce_bucket_size: int | None,
    sub_group_size: int | None,
) -> dict[str, Any]:
    """The DeepSpeed-style config the strategies' keyword arguments describe."""
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = reduce_bucket_size
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    return {"zero_optimization": zero}


def load_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed JSON config from a path or a dict (copied)."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, str | os.PathLike):
        if not os.path.isfile(config):
            raise FileNotFoundError(f"ZeroShardStrategy: config file {config} does not exist")
        with open(config) as f:
            return json.load(f)
    raise TypeError(
        f"ZeroShardStrategy(config=...) must be a DeepSpeed JSON path or a dict, got "
        f"{type(config).__name__}"
    )


def _agree(config: dict[str, Any], key: str, value: Any, source: str) -> None:
    current = config.pop(key, "auto")
    if current != "auto" and current != value:
        raise ValueError(
            f"ZeroShardStrategy's config has {key} = {current!r} but {source} gives {value!r}; "
            'remove the key, set it to "auto" or make them agree'
        )


class ZeroArguments:
    """The ZeroOptimizer options a config gives (everything but the optimizer)."""

    def __init__(
        self,
        config: dict[str, Any],
        world_size: int,
        precision: str,
        accumulation: int | None,
        clip: float | None,
    ) -> None:
        """``accumulation`` / ``clip``: the Trainer's (None under Fabric, where the
        loop decides: the config must not set them)."""
        config = copy.deepcopy(config)
        for key in ("optimizer", "scheduler"):
            if key in config:
                raise ValueError(
                    f"ZeroShardStrategy's config has an {key!r} section: under Lightning the "
                    "optimizer and its LR scheduler come from configure_optimizers (Trainer) or "
                    "your script (Fabric), and zeroshard builds a ZeroOptimizer with their "
                    "hyper-parameters. Remove the section"
                )
        wanted = {"fp16": precision.startswith("16-"), "bf16": precision.startswith("bf16-")}
        # fp16's loss scale, from the config's fp16 section (DeepSpeed's keys).
        self.loss_scale: DynamicLossScale | None = None
        self.skip_nonfinite_steps = precision in LOSS_SCALED
        for name, enabled in wanted.items():
            section = config.pop(name, None) or {}
            flag = section.get("enabled", "auto")
            if flag != "auto" and bool(flag) != enabled:
                raise ValueError(
                    f"ZeroShardStrategy's config has {name}.enabled = {flag!r} but the precision "
                    f"is {precision!r}; the precision argument of Trainer/Fabric decides: set "
                    f'it to "auto" or make them agree'
                )
            if name == "bf16" and section.get("check_grad_overflow", False):
                self.skip_nonfinite_steps = True
            if name == "fp16" and precision in LOSS_SCALED:
                self.loss_scale = DynamicLossScale.from_config(section)
        if accumulation is not None:  # the Trainer
            _agree(config, "gradient_accumulation_steps", accumulation, "accumulate_grad_batches")
            if clip is not None or "gradient_clipping" in config:
                _agree(config, "gradient_clipping", float(clip or 0.0), "gradient_clip_val")
        else:  # Fabric: the loop accumulates (no_backward_sync) and clips (clip_gradients)
            loop = "your Fabric loop (no_backward_sync, clip_gradients)"
            _agree(config, "gradient_accumulation_steps", 1, loop)
            _agree(config, "gradient_clipping", 0.0, loop)
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            config.pop(key, None)  # the DataLoader decides
        config.update(
            train_batch_size=world_size,
            train_micro_batch_size_per_gpu=1,
            gradient_accumulation_steps=1,
            gradient_clipping=0.0,
            # The parser asks for one; the torch.optim optimizer's type and
            # hyper-parameters are the ones used.
            optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
        )
        parsed = _C.parse_deepspeed_config(json.dumps(config), world_size)
        if parsed.has_auto_settings():
            raise ValueError(
                'ZeroShardStrategy: "auto" stage or offload devices are not supported under '
                "Lightning yet; set zero_optimization.stage and the offload devices"
            )
        parsed.check_supported()
        zero = dict(parsed.optimizer_arguments()["zero_options"])
        self.stage: int = int(zero.pop("stage"))
        zero.pop("max_norm", None)
        self.options = zero
        self.unit_class_names: list[str] = list(parsed.unit_classes)
        if self.unit_class_names and self.stage != 3:
            raise ValueError(
                f"zeroshard.unit_classes is a stage 3 setting; zero_optimization.stage is "
                f"{self.stage}"
            )


# torch.optim keys that choose how torch computes the update (zeroshard's
# C++ update replaces it), and those that change what it computes, with the
# value zeroshard implements.
_IMPLEMENTATION_KEYS = {"foreach", "fused"}
_UNSUPPORTED_UNLESS = {"maximize": False, "capturable": False, "differentiable": False}
_KINDS = {torch.optim.AdamW: "adam", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}


def _kind(optimizer: torch.optim.Optimizer) -> str | type[torch.optim.Optimizer]:
    """zeroshard's name for the C++ kernel of ``optimizer``'s class, or the class
    itself (RAdam, Muon, ...: ZeroOptimizer runs it as a torch.optim class,
    refusing, naming it, one whose state is not per element)."""
    kind = _KINDS.get(type(optimizer))
    if kind is None:
        return type(optimizer)
    if kind == "adam":
        decoupled = {bool(g.get("decoupled_weight_decay", False)) for g in optimizer.param_groups}
        if decoupled == {True}:
            return "adamw"
        if decoupled != {False}:
            raise ValueError(
                "ZeroShardStrategy: the optimizer's parameter groups mix decoupled_weight_decay "
                "True and False; zeroshard runs one update rule per optimizer"
            )
    return kind


def zero_optimizer_from(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    arguments: ZeroArguments,
    unit_classes: Sequence[type[nn.Module]] = (),
    param_init_fn: Any = None,
    device: torch.device | str = "cpu",
) -> ZeroOptimizer:
    """A ZeroOptimizer over ``optimizer``'s parameter groups, with their hyper-parameters.

    ``optimizer`` is a torch.optim optimizer: AdamW, Adam and SGD run zeroshard's
    kernels, any other class runs as itself on zeroshard's shards (a
    ZeroOptimizer is returned as it is). Its state must be empty: the update has not started.
    Stage 3 materializes a meta-built ``module`` on ``device``.
    """
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer
    kind = _kind(optimizer)
    if any(optimizer.state.values()):
        raise ValueError(
            "ZeroShardStrategy: the optimizer already holds state (it has stepped); build the "
            "ZeroOptimizer from a fresh one"
        )
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        converted: dict[str, Any] = {}
        if not isinstance(kind, str):  # the class's own keywords, all of them
            groups.append({k: v for k, v in group.items() if k != "param_names"})
            continue
        for key, value in group.items():
            if key in _IMPLEMENTATION_KEYS or key == "decoupled_weight_decay":
                continue
            if key in _UNSUPPORTED_UNLESS:
                if bool(value) != _UNSUPPORTED_UNLESS[key]:
                    raise ValueError(
                        f"ZeroShardStrategy: parameter group {index} of the "
                        f"{type(optimizer).__name__} sets {key}={value!r}, which zeroshard's "
                        f"update does not implement; use {key}={_UNSUPPORTED_UNLESS[key]}"
                    )
                continue
            converted[key] = value
        groups.append(converted)
    stage3: dict[str, Any] = {}
    if arguments.stage == 3:
        classes = tuple(unit_classes) + resolve_unit_classes(module, arguments.unit_class_names)
        stage3 = {
            "unit_classes": classes,
            "param_init_fn": param_init_fn,
            "materialize_device": device,
        }
    options = dict(arguments.options)
    options["skip_nonfinite_steps"] = arguments.skip_nonfinite_steps or bool(
        options.get("skip_nonfinite_steps", False)
    )
    zero = ZeroOptimizer(groups, kind, arguments.stage, module=module, **stage3, **options)
    # A scheduler still holding the torch optimizer (one not handed over)
    # edits the ZeroOptimizer's learning rates, not stale copies.
    optimizer.param_groups = zero.param_groups
    return zero


def retarget_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: ZeroOptimizer) -> None:
    """Points an LR scheduler built on ``old`` at ``new`` (same groups, same order).

    torch's schedulers wrap their optimizer's ``step`` to warn about a
    ``scheduler.step()`` before the first ``optimizer.step()``; ``new`` gets
    the same wrapper.
    """
    if getattr(scheduler, "optimizer", None) is not old:
        raise ValueError(
            "ZeroShardStrategy: an LR scheduler is attached to an optimizer other than the one "
            "being converted to a ZeroOptimizer"
        )
    scheduler.optimizer = new
    if hasattr(new.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(new)  # the optimizer must not keep itself alive through its step
    step = type(new).step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        live = ref()
        assert live is not None
        live._opt_called = True  # type: ignore[attr-defined]
        return step(live, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    new.step = wrapper  # type: ignore[method-assign]


class DynamicLossScale:
    """fp16 loss scaling (DeepSpeed's defaults and keys, no hysteresis).

    The loss is multiplied by ``scale`` before backward; the optimizer divides
    the reduced gradients by it (``set_loss_scale``), skips a step whose
    gradients overflowed on any rank (``skip_nonfinite_steps``), and then the
    scale halves (not below ``min_scale``); after ``window`` good steps in a
    row it doubles. A ``static_scale`` > 0 stays as it is.
    """

    def __init__(
        self,
        initial_scale_power: int = 16,
        window: int = 1000,
        min_scale: float = 1.0,
        static_scale: float = 0.0,
    ) -> None:
        self.static = static_scale > 0
        self.scale = float(static_scale) if self.static else float(2**initial_scale_power)
        self.window = window
        self.min_scale = min_scale
        self.good_steps = 0

    @classmethod
    def from_config(cls, fp16: Mapping[str, Any]) -> DynamicLossScale:
        """From a DeepSpeed config's ``fp16`` section (``loss_scale`` 0 is dynamic)."""
        return cls(
            initial_scale_power=int(fp16.get("initial_scale_power", 16)),
            window=int(fp16.get("loss_scale_window", 1000)),
            min_scale=float(fp16.get("min_loss_scale", 1.0)),
            static_scale=float(fp16.get("loss_scale", 0.0)),
        )

    def update(self, skipped: bool) -> None:
        """After a step: lower the scale on an overflow, raise it after a window."""
        if self.static:
            return
        if skipped:
            self.scale = max(self.scale / 2, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """The scale and the count of good steps."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict()``."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds (not sharded: equal on every rank)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer.detach().cpu().clone()
    return out


def load_buffers(module: nn.Module, saved: Mapping[str, torch.Tensor], strict: bool) -> None:
    """Copies saved buffers into ``module``'s (checkpoints hold them beside the shards)."""
    lookup = dict(module.named_buffers())
    current = persistent_buffers(module)
    missing = sorted(set(current) - set(saved))
    if missing and strict:
        raise ValueError(f"the checkpoint has no value for buffer(s) {missing[:5]}")
    with torch.no_grad():
        for name in current:
            if name in saved:
                lookup[name].copy_(saved[name])


def _agreed(strategy: Any, failure: str | None, what: str) -> None:
    """Collective: raises on every rank if rank 0 failed (its ``failure``)."""
    failure = strategy.broadcast(failure, src=0)
    if failure is not None:
        raise RuntimeError(f"ZeroShardStrategy: {what} failed on rank 0: {failure}")


def write_checkpoint_directory(
    strategy: Any, path: str | os.PathLike[str], zero: ZeroOptimizer, state: dict[str, Any]
) -> Path:
    """Collective: the checkpoint directory ``path``: the zeroshard checkpoint
    (every rank's shard) and Lightning's ``state`` (written by rank 0).

    Written whole into a staging directory beside ``path``, which then takes
    ``path``'s place (the previous checkpoint of that name is removed after):
    an interrupted save leaves the previous checkpoint, never a directory
    mixing the new shards with the old Lightning state. Every rank writes into
    rank 0's path (a file system they share). A failure on rank 0 raises on
    every rank.
    """
    root = Path(strategy.broadcast(os.fspath(path), src=0))
    staging = root.with_name(f".{root.name}.zeroshard-staging")
    retired = root.with_name(f".{root.name}.zeroshard-retired")
    failure = None
    if strategy.is_global_zero:
        try:
            if root.is_file():
                raise FileExistsError(
                    f"{root} is a file; a ZeroShardStrategy checkpoint is a directory of that name"
                )
            for leftover in (staging, retired):  # of an interrupted save
                shutil.rmtree(leftover, ignore_errors=True)
            staging.mkdir(parents=True)
        except Exception as error:  # noqa: BLE001 - raised below, on every rank
            failure = f"{type(error).__name__}: {error}"
    _agreed(strategy, failure, f"preparing checkpoint {root}")
    zero.save_checkpoint(staging / ZEROSHARD_SUBDIR)
    if strategy.is_global_zero:
        try:
            torch.save(state, staging / LIGHTNING_STATE_FILE)
            if root.exists() or root.is_symlink():
                os.replace(root, retired)
            os.replace(staging, root)
            shutil.rmtree(retired, ignore_errors=True)
        except Exception as error:  # noqa: BLE001 - raised below, on every rank
            failure = f"{type(error).__name__}: {error}"
    _agreed(strategy, failure, f"writing checkpoint {root}")
    return root


def check_checkpoint_directory(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path if it is a ZeroShardStrategy checkpoint, else ValueError."""
    root = Path(path)
    if not (root / ZEROSHARD_SUBDIR).is_dir() or not (root / LIGHTNING_STATE_FILE).is_file():
        raise ValueError(
            f"{root} is not a ZeroShardStrategy checkpoint (a directory holding "
            f"{ZEROSHARD_SUBDIR}/ and {LIGHTNING_STATE_FILE}). A plain Lightning .ckpt file "
            "cannot be resharded: load its weights into the model before fit (e.g. "
            "LightningModule.load_from_checkpoint) and train from there"
        )
    return root


def first_meta_parameter(module: nn.Module) -> str | None:
    """The name of a parameter of ``module`` on the meta device, if any."""
    return next((n for n, p in module.named_parameters() if p.is_meta), None)


def buffers_to_device(module: nn.Module, device: torch.device) -> None:
    """A meta-built model's buffers onto ``device`` (its parameters are the
    ZeroOptimizer's to materialize). A buffer built on the meta device has no
    value to keep: refused, naming it."""
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is None:
                continue
            if buffer.is_meta:
                full = f"{prefix}.{name}" if prefix else name
                raise ValueError(
                    f"buffer {full!r} was built on the meta device, so it has no value; under "
                    "stage 3 configure_model builds on the meta device: create buffers with an "
                    "explicit device (torch.tensor(..., device='cpu')) or outside configure_model"
                )
            sub._buffers[name] = buffer.to(device)


def materialize_without_optimizer(module: nn.Module, device: torch.device) -> None:
    """A meta-built model outside training (validate/test/predict): real storage
    on ``device``, initialized by each module's ``reset_parameters`` (the
    checkpoint's weights are loaded over it)."""
    module.to_empty(device=device)
    with torch.no_grad():
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if reset is not None and any(True for _ in sub.parameters(recurse=False)):
                reset()


def strategy_config(
    config: Any,
    stage: int,
    offload_optimizer: bool,
    offload_parameters: bool,
    pin_memory: bool,
    reduce_bucket_size: int | None,
    sub_group_size: int | None,
) -> dict[str, Any]:
    """The DeepSpeed config both strategies (Trainer, Fabric) run with: the
    user's ``config`` (a path or dict), or one made from the keyword options."""
    if config is not None:
        return load_config(config)
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeroShardStrategy(stage=...) must be 1, 2 or 3, got {stage!r}")
    if offload_parameters and stage != 3:
        raise ValueError("ZeroShardStrategy(offload_parameters=True) needs stage=3")
    return default_config(
        stage, offload_optimizer, offload_parameters, pin_memory, reduce_bucket_size, sub_group_size
    )
