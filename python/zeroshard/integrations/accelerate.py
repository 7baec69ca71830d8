"""zeroshard in a script launched with ``accelerate launch`` (or torchrun).

    accelerator = Accelerator(gradient_accumulation_steps=2)  # cpu=True on CPUs
    model.to(accelerator.device)                      # before building the optimizer
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), stage=2, lr=1e-3)
    model, optimizer, loader, scheduler = zeroshard.integrations.accelerate.prepare(
        accelerator, model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):           # no_sync on the micro-steps
            accelerator.backward(model(batch).loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # zeroshard's global norm
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                    # ... accelerator.load_state("ckpt")

What ``prepare`` does instead of ``accelerator.prepare(model, optimizer, ...)``:

- The model gets accelerate's autocast (mixed precision) but no
  DistributedDataParallel: zeroshard reduces the gradients itself.
- ``model.no_sync()`` is the optimizer's, so ``accelerator.accumulate`` and
  ``accelerator.no_sync`` skip communication on the micro-steps.
- ``accelerator.clip_grad_norm_`` clips by zeroshard's global norm and
  returns it (torch's would see the ``.grad`` stages 2-3 freed).
- ``save_state`` / ``load_state`` write and read a zeroshard checkpoint in
  ``<dir>/zeroshard`` (the optimizer state and the weights, loadable at any
  world size or stage; ``python -m zeroshard consolidate <dir>/zeroshard out``
  makes safetensors of it); accelerate no longer saves this model's
  ``state_dict`` (at stage 3 one rank has only its shard) nor the optimizer's
  (one rank's shard, which the other ranks must not load).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch.distributed as dist
from torch import nn

from zeroshard.integrations import attach_no_sync, global_norm_clipper, unwrap_optimizer
from zeroshard.optimizer import ZeroOptimizer

CHECKPOINT_SUBDIR = "zeroshard"
_MARKER = {"zeroshard": f"the optimizer state is the zeroshard checkpoint in {CHECKPOINT_SUBDIR}/"}


def prepare(accelerator: Any, model: nn.Module, optimizer: ZeroOptimizer, *others: Any) -> Any:
    """Collective: prepares ``model`` and its ``ZeroOptimizer`` for ``accelerator``.

    ``others`` (data loaders, schedulers) go through ``accelerator.prepare``.
    Returns ``(model, optimizer, *others)`` prepared, in that order.
    """
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            "zeroshard.integrations.accelerate.prepare expects a zeroshard.ZeroOptimizer, got "
            f"{type(optimizer).__name__}"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if accelerator.num_processes != world:
        # E.g. `accelerate launch --multi_gpu` on a host without GPUs: accelerate
        # falls back to one process per rank and would give each rank all the data.
        raise RuntimeError(
            f"accelerate sees {accelerator.num_processes} process(es) but the process group has "
            f"{world} ranks, so its data loaders would not split the data between them. On "
            "CPUs build Accelerator(cpu=True) and launch with torchrun; on GPUs launch with "
            "`accelerate launch --multi_gpu --num_processes N` or torchrun"
        )
    device = accelerator.device
    elsewhere = [
        n for n, p in model.named_parameters() if p.device.type != device.type
    ]  # fmt: skip
    if elsewhere:
        raise ValueError(
            f"{len(elsewhere)} parameters (first {elsewhere[0]!r}) are not on the accelerator's "
            f"device {device}: move the model (model.to(accelerator.device)) before building "
            "the ZeroOptimizer"
        )
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    # accelerate must neither save nor load this model's state_dict: the
    # zeroshard checkpoint holds its weights.
    accelerator._models[:] = [m for m in accelerator._models if m is not model]
    attach_no_sync(model, optimizer)
    optimizer.name_parameters(model)  # checkpoints keyed as model.state_dict()
    clip = global_norm_clipper(optimizer)
    state = accelerator.gradient_state

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        # Collective: only where the optimizer steps (the accumulation
        # boundary), as the gradients are whole only there.
        if not state.sync_gradients:
            return None
        return clip(parameters, max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    prepared = accelerator.prepare(optimizer, *others)
    if not others:
        prepared = (prepared,)
    wrapper = prepared[0]
    # What accelerate saves (rank 0 only) and loads (every rank) as the
    # optimizer's state is a marker: the state is in the zeroshard checkpoint.
    wrapper.state_dict = lambda: dict(_MARKER)
    wrapper.load_state_dict = _check_marker
    _register_checkpoint_hooks(accelerator, optimizer)
    return (model, *prepared)


def _check_marker(state: dict[str, Any]) -> None:
    if state != _MARKER:
        raise ValueError(
            "this accelerate checkpoint's optimizer state was not saved through "
            "zeroshard.integrations.accelerate.prepare; a ZeroOptimizer loads its state from "
            f"the {CHECKPOINT_SUBDIR}/ checkpoint that save_state writes"
        )


def _register_checkpoint_hooks(accelerator: Any, optimizer: ZeroOptimizer) -> None:
    ref = weakref.ref(optimizer)

    def save(models: Any, weights: Any, output_dir: str) -> None:
        live = ref()
        if live is not None:
            os.makedirs(output_dir, exist_ok=True)
            live.save_checkpoint(os.path.join(output_dir, CHECKPOINT_SUBDIR))

    def load(models: Any, input_dir: str) -> None:
        live = ref()
        if live is None:
            return
        path = os.path.join(input_dir, CHECKPOINT_SUBDIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{input_dir} holds no zeroshard checkpoint ({CHECKPOINT_SUBDIR}/): it was not "
                "saved by accelerator.save_state after zeroshard.integrations.accelerate.prepare"
            )
        live.load_checkpoint(path)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


__all__ = ["prepare", "unwrap_optimizer"]
