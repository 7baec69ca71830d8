"""Composition with ``torch.distributed.pipelining``: ZeRO per pipeline stage.

Each pipeline stage builds its own ``ZeroOptimizer`` over that stage's
data-parallel group (the ranks holding the same stage in the other pipeline
replicas) and wraps its submodule in :class:`PipelineStage` instead of
torch's. A schedule runs one backward per micro-batch and then divides
``.grad`` by the number of micro-batches (``scale_grads``); zeroshard's
hooks would reduce each micro-batch's gradients and release ``.grad``, so
the schedule's division would find nothing to divide and the reduced
gradient would be the sum, not the mean. This stage therefore runs every
micro-batch's backward under ``optimizer.no_sync()``: gradients accumulate
in ``.grad``, the schedule scales them, and ``optimizer.step()`` reduces
them once per step, as DeepSpeed's pipeline engine does.

    stage = zeroshard.pipelining.PipelineStage(
        submodule, stage_index, num_stages, device, group=pp_group, optimizer=optimizer
    )
    schedule = torch.distributed.pipelining.Schedule1F1B(stage, n_microbatches, loss_fn)
    schedule.step(x)  # first stage; the last one passes target= and losses=
    optimizer.step()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from zeroshard.optimizer import ZeroOptimizer

__all__ = ["PipelineStage"]


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` for a submodule whose optimizer is a ``ZeroOptimizer``.

    Args:
        submodule, stage_index, num_stages, device, group, input_args,
            output_args, dw_builder: as ``torch.distributed.pipelining.PipelineStage``.
        optimizer: the stage's ``ZeroOptimizer`` (stage 1 or 2), built over the
            stage's data-parallel group with ``submodule``'s parameters.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        group: dist.ProcessGroup | None = None,
        dw_builder: Any = None,
        *,
        optimizer: ZeroOptimizer,
    ) -> None:
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError(
                "optimizer must be the stage's zeroshard.ZeroOptimizer, got "
                f"{type(optimizer).__name__}"
            )
        if optimizer._stage == 3:
            # Each micro-batch's forward and backward would gather the stage's
            # units again, and the accumulated full gradients would sit on
            # released parameters until the step: neither is built or tested.
            raise ValueError(
                "zeroshard stage 3 with pipeline parallelism is not supported yet; use "
                "stage 1 or 2 per pipeline stage (a stage already holds 1/PP of the model; "
                "DeepSpeed's pipeline engine allows stage 1 only)"
            )
        owned = {id(p) for group_ in optimizer.param_groups for p in group_["params"]}
        missing = [name for name, p in submodule.named_parameters() if id(p) not in owned]
        if missing:
            raise ValueError(
                f"the optimizer does not hold the stage's parameters {missing[:4]}"
                f"{' ...' if len(missing) > 4 else ''}; build it from submodule.parameters()"
            )
        super().__init__(
            submodule, stage_index, num_stages, device, input_args, output_args, group, dw_builder
        )
        self._zero_optimizer = optimizer

    def scale_grads(self, grad_scale_factor: int) -> None:
        """torch's division of ``.grad``, and of DTensor parameters' local gradients."""
        super().scale_grads(grad_scale_factor)
        if grad_scale_factor != 1:
            self._zero_optimizer._tensor_parallel.scale_local_gradients(grad_scale_factor)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        """Every micro-batch accumulates into ``.grad``; ``step()`` reduces once."""
        with self._zero_optimizer.no_sync():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
