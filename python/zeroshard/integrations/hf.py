"""``ZeroTrainer``: Hugging Face ``Trainer`` with a zeroshard optimizer.

    trainer = ZeroTrainer(model=model, args=TrainingArguments(...),
                          train_dataset=..., zeroshard_config="zero.json")
    trainer.train()            # resume_from_checkpoint= works at any world size
    trainer.save_model("out")  # a Hugging Face folder: from_pretrained loads it

``zeroshard_config`` is DeepSpeed's JSON (a path or a dict). ``"auto"`` values
are filled from the ``TrainingArguments`` as Trainer does for DeepSpeed: the
batch sizes, accumulation steps, clipping, the optimizer's lr, betas, eps and
weight decay, bf16. What it changes from ``Trainer``:

- No DistributedDataParallel: the model is prepared by accelerate for
  autocast only (``evaluation_mode=True``); zeroshard reduces the gradients.
- Accumulation micro-steps run inside ``optimizer.no_sync()``.
- Clipping and the logged ``grad_norm`` use zeroshard's global norm (at
  stages 2-3 ``.grad`` is freed during backward: torch's clip sees nothing).
- With ``bf16.check_grad_overflow: true`` (DeepSpeed's key; any precision
  here) a step whose gradients hold inf/NaN changes nothing, and Trainer does
  not advance the LR schedule for it.
- Checkpoints hold a zeroshard checkpoint in ``checkpoint-N/zeroshard`` (any
  world size or stage can resume it) and the scheduler; ``save_model`` writes
  the full weights (gathered from every rank's shard) with ``save_pretrained``.
- At stage 3 ``model.generate`` defaults to ``synced_gpus=True``, so ranks that
  stop at different lengths keep gathering with the others instead of hanging.
- A config without an ``"optimizer"`` section takes ``TrainingArguments.optim``
  as Trainer would (``optim="adafactor"``: transformers' Adafactor, each
  matrix's factored statistics held by its owner); an AdamW ``optim`` is the
  config's "auto" AdamW.

Supported: transformers 5.x (tested with 5.25) and accelerate >= 1.10
(tested with 1.15). Not supported, with a clear error: ``deepspeed=`` or FSDP
in the ``TrainingArguments``, fp16 (use bf16), ``auto_find_batch_size``,
``optimizers=`` (the optimizer comes from the config), ``load_best_model_at_end``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import _C
from zeroshard.deepspeed_muon import muon_param_groups
from zeroshard.integrations import attach_no_sync
from zeroshard.optimizer import ZeroOptimizer

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer import SCHEDULER_NAME
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "zeroshard.integrations.hf needs transformers: pip install 'zeroshard[hf]' "
        "(or 'transformers>=5')"
    ) from error

CHECKPOINT_SUBDIR = "zeroshard"
_AUTO = "auto"


def _load(config: str | os.PathLike[str] | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, str | os.PathLike):
        with open(config) as f:
            return json.load(f)
    raise TypeError(f"zeroshard_config must be a path or a dict, got {type(config).__name__}")


def _fill(section: dict[str, Any], key: str, value: Any, where: str) -> None:
    """Sets ``section[key]`` to ``value`` where it is "auto" or missing; a set
    value must agree with the TrainingArguments (as HF's DeepSpeed check)."""
    current = section.get(key, _AUTO)
    if current == _AUTO:
        section[key] = value
    elif current != value and not (
        isinstance(current, list | tuple) and list(current) == list(value)
    ):
        raise ValueError(
            f"zeroshard_config {where}{key} = {current!r} but the TrainingArguments give "
            f'{value!r}; set it to "auto" or make them agree'
        )


def fill_auto(config: dict[str, Any], args: Any, world_size: int) -> dict[str, Any]:
    """The config with its "auto" values filled from ``args`` (TrainingArguments).

    Mixed-precision sections are checked against ``args`` and dropped: under
    Trainer, bf16 is accelerate's autocast over fp32 weights, which the
    optimizer sees as fp32. A scheduler section must be all "auto" (Trainer's
    ``lr_scheduler_type`` drives the schedule).
    """
    config = copy.deepcopy(config)
    micro = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    _fill(config, "train_micro_batch_size_per_gpu", micro, "")
    _fill(config, "gradient_accumulation_steps", accumulation, "")
    _fill(config, "train_batch_size", micro * accumulation * world_size, "")
    _fill(config, "gradient_clipping", float(args.max_grad_norm), "")
    optimizer = config.setdefault("optimizer", {"type": "AdamW", "params": {}})
    kind = str(optimizer.get("type", "AdamW")).lower()
    params = optimizer.setdefault("params", {})
    _fill(params, "lr", float(args.learning_rate), "optimizer.params.")
    _fill(params, "weight_decay", float(args.weight_decay), "optimizer.params.")
    if kind in ("adam", "adamw", "muon"):  # Muon: its Adam half's
        _fill(
            params, "betas", [float(args.adam_beta1), float(args.adam_beta2)], "optimizer.params."
        )
        _fill(params, "eps", float(args.adam_epsilon), "optimizer.params.")
    for name, enabled in (("fp16", bool(args.fp16)), ("bf16", bool(args.bf16))):
        section = config.pop(name, None) or {}
        wanted = section.get("enabled", _AUTO)
        if wanted != _AUTO and bool(wanted) != enabled:
            raise ValueError(
                f"zeroshard_config {name}.enabled = {wanted!r} but TrainingArguments({name}="
                f'{enabled}); set it to "auto" or make them agree'
            )
    scheduler = config.pop("scheduler", None)
    if scheduler is not None and any(v != _AUTO for v in scheduler.get("params", {}).values()):
        raise ValueError(
            "zeroshard_config has a scheduler section with values of its own; under "
            "ZeroTrainer the TrainingArguments' lr_scheduler_type and warmup drive the "
            'schedule. Remove the section or set its params to "auto"'
        )
    return config


def _trainer_optimizer(
    args: Any, model: nn.Module, source: dict[str, Any]
) -> tuple[type, dict[str, Any]] | None:
    """The class and keywords Trainer picks for ``args.optim`` (``"adafactor"``:
    transformers' Adafactor with ``lr``), when the zeroshard config names no
    optimizer and ``optim`` is not an AdamW, which the config's "auto"
    filling already gives; None otherwise. ZeroOptimizer runs the class
    (update_rules.py) or refuses it, naming it."""
    if "optimizer" in source:
        return None
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    if isinstance(cls, type) and issubclass(cls, torch.optim.AdamW):
        return None
    return cls, dict(kwargs)


def _check_arguments(args: Any, kwargs: dict[str, Any]) -> None:
    problems = []
    if getattr(args, "deepspeed", None):
        problems.append("TrainingArguments(deepspeed=...) (zeroshard replaces DeepSpeed here)")
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_config", None) not in (None, {}):
        if getattr(args, "fsdp", None):
            problems.append("TrainingArguments(fsdp=...) (zeroshard shards the model itself)")
    if args.fp16:
        problems.append("fp16=True (not supported with zeroshard's Trainer yet: use bf16=True)")
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size=True (the config's batch sizes are fixed)")
    if args.load_best_model_at_end:
        problems.append("load_best_model_at_end=True (not supported yet)")
    optimizers = kwargs.get("optimizers")
    if optimizers is not None and any(o is not None for o in optimizers):
        problems.append("optimizers=(...) (ZeroTrainer builds the optimizer from zeroshard_config)")
    if problems:
        raise ValueError("ZeroTrainer does not support " + "; ".join(problems))


class _SkippedStepsKeepTheSchedule(TrainerCallback):
    """Tells accelerate that zeroshard skipped the step, so that Trainer does
    not advance the LR schedule (it checks ``optimizer_step_was_skipped``)."""

    def __init__(self, trainer: ZeroTrainer) -> None:
        self._trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = self._trainer.zero_optimizer
        wrapper = self._trainer.optimizer
        if optimizer is not None and wrapper is not optimizer:
            wrapper._is_overflow = optimizer.last_step_skipped()  # AcceleratedOptimizer


class ZeroTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with ``zeroshard.ZeroOptimizer``.

    Takes every ``Trainer`` argument plus ``zeroshard_config`` (DeepSpeed's
    JSON, a path or a dict) and ``unit_classes`` (stage 3's gathering units,
    if the default policy does not suit the model). See the module docstring.
    """

    def __init__(
        self,
        *args: Any,
        zeroshard_config: str | os.PathLike[str] | dict[str, Any],
        unit_classes: tuple[type[nn.Module], ...] = (),
        **kwargs: Any,
    ) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _check_arguments(training_args, kwargs)
        super().__init__(*args, **kwargs)
        _check_arguments(self.args, kwargs)
        self._zeroshard_source = _load(zeroshard_config)
        self._unit_classes = tuple(unit_classes)
        self.zero_optimizer: ZeroOptimizer | None = None
        self.add_callback(_SkippedStepsKeepTheSchedule(self))

    # The optimizer ------------------------------------------------------------

    def zeroshard_config(self) -> dict[str, Any]:
        """The config with its "auto" values filled from the TrainingArguments."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return fill_auto(self._zeroshard_source, self.args, world)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Builds the ZeroOptimizer (Trainer's decay / no-decay groups)."""
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        world = dist.get_world_size() if dist.is_initialized() else 1
        config = self.zeroshard_config()
        # Trainer clips (with the config's value, checked equal to max_grad_norm).
        parsed = _C.parse_deepspeed_config(json.dumps(dict(config, gradient_clipping=0.0)), world)
        parsed.check_supported()
        arguments = parsed.optimizer_arguments()
        zero = dict(arguments["zero_options"])
        stage = zero.pop("stage")
        zero.pop("max_norm")
        hyper = dict(arguments["hyperparameters"])
        kind = arguments["optimizer"]
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [
            {"params": [p for n, p in named if n in decay]},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        client = _trainer_optimizer(self.args, model, self._zeroshard_source)
        if client is not None:  # TrainingArguments.optim's class (optim="adafactor")
            kind, hyper = client
            for group in groups:
                group.setdefault("weight_decay", float(self.args.weight_decay))
        elif kind == "muon":  # each group in Muon and Adam halves, as DeepSpeed's
            groups = muon_param_groups(model, groups, hyper)
            kind, hyper = "adamw", {}
        else:
            for group in groups:
                group.setdefault("weight_decay", hyper["weight_decay"])
            hyper.pop("weight_decay")
        # DeepSpeed's bf16.check_grad_overflow: a step whose gradients hold
        # inf/NaN changes nothing (and the schedule waits); here under any
        # precision, as Trainer's bf16 is autocast over fp32 weights.
        bf16 = self._zeroshard_source.get("bf16") or {}
        zero["skip_nonfinite_steps"] = bool(bf16.get("check_grad_overflow", False))
        stage3: dict[str, Any] = {}
        if stage == 3:
            stage3 = {"module": model, "unit_classes": self._unit_classes}
        optimizer = ZeroOptimizer(
            groups,
            kind,
            stage,
            param_names=dict(model.named_parameters(remove_duplicate=False)),
            **stage3,
            **zero,
            **hyper,
        )
        self.zero_optimizer = optimizer
        self.optimizer = optimizer
        if stage != 3:  # stage 3 has module= and did it
            optimizer.broadcast_buffers(model)  # as accelerate's DDP would have
        attach_no_sync(model, optimizer)
        if stage == 3 and hasattr(model, "generate"):
            _synced_generate(model)
        return optimizer

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        # Autocast only: accelerate's DDP would reduce the gradients a second
        # time (and at stage 3 read released parameters).
        if self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            return model
        return self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self._zero().clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            # inf: the norm alone (the coefficient is clamped at 1).
            grad_norm = self._zero().clip_grad_norm_(float("inf"))
        return grad_norm

    def _zero(self) -> ZeroOptimizer:
        if self.zero_optimizer is None:
            raise RuntimeError("ZeroTrainer: the zeroshard optimizer is built by train()")
        return self.zero_optimizer

    # Checkpoints --------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Collective: every rank writes its shard; the checkpoint loads at any
        # world size or stage.
        self._zero().save_checkpoint(os.path.join(output_dir, CHECKPOINT_SUBDIR))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{checkpoint} holds no zeroshard checkpoint ({CHECKPOINT_SUBDIR}/): was it "
                "saved by ZeroTrainer? A plain Trainer checkpoint's optimizer.pt cannot be "
                "resharded"
            )
        self._zero().load_checkpoint(path)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: the full weights as a Hugging Face folder (``from_pretrained``)."""
        if self.zero_optimizer is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = full_model_state_dict(self.model, self.zero_optimizer)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def full_model_state_dict(model: nn.Module, optimizer: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Collective: ``model.state_dict()`` with full values, on rank 0 (empty elsewhere).

    Parameters come from the optimizer's master weights, cast to each
    parameter's dtype (tied parameters share one tensor under every name);
    persistent buffers from the model (they are not sharded).
    """
    values = optimizer.full_state_dict(rank=0)
    if not values:
        return {}
    dtypes = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
    cast: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if id(value) not in cast:
            cast[id(value)] = value.to(dtypes.get(name, value.dtype))
        state[name] = cast[id(value)]
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set:
                key = f"{module_name}.{buffer_name}" if module_name else buffer_name
                state[key] = buffer.detach().clone()
    return state


def _synced_generate(model: nn.Module) -> None:
    """At stage 3 a rank that finished generating must keep joining the others'
    gathers: ``synced_gpus=True`` by default (as transformers does for ZeRO-3)."""
    generate = model.generate

    @functools.wraps(generate)
    def synced(*args: Any, **kwargs: Any) -> Any:
        if "synced_gpus" not in kwargs:
            kwargs["synced_gpus"] = dist.is_initialized() and dist.get_world_size() > 1
        return generate(*args, **kwargs)

    model.generate = synced  # type: ignore[method-assign]


__all__ = ["ZeroTrainer", "fill_auto", "full_model_state_dict"]
