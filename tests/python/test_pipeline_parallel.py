"""ZeRO per pipeline stage: DP 2 x PP 2 on 4 CPU ranks with torch.distributed.pipelining.

A two-stage GPT (embeddings and a block; a block, the final norm and the
head) under GPipe and 1F1B schedules with 2 micro-batches, zeroshard
stages 1 and 2 over each pipeline stage's data-parallel group, compared with
single-process ``torch.optim`` on the whole model and the global batch.
Gradients are reduced once per step, not per micro-batch (counted).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
import zeroshard.pipelining

from dist_harness import RankError, run_ranks, unwrap
from tiny_models import SEQ, VOCAB, Block

WORLD, PP, DP = 4, 2, 2
STEPS, MICRO = 5, 2
BATCH = 8  # global: 4 per data-parallel rank, 2 per micro-batch
LR = 1e-2
WIDTH, HIDDEN = 8, 12
TOLERANCE = 1e-6


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)
        self.block = Block(WIDTH, HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.block(self.wte(tokens) + self.wpe[: tokens.shape[1]])


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block(WIDTH, HIDDEN)
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.block(x)))


def make_stages() -> tuple[First, Last]:
    torch.manual_seed(0)
    return First(), Last()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference() -> dict[str, torch.Tensor]:
    first, last = make_stages()
    params = list(first.parameters()) + list(last.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR)
    for step in range(STEPS):
        tokens, targets = batch(step)
        optimizer.zero_grad()
        loss_fn(last(first(tokens)), targets).backward()
        optimizer.step()
    return {
        **{f"0.{n}": p.detach().clone() for n, p in first.named_parameters()},
        **{f"1.{n}": p.detach().clone() for n, p in last.named_parameters()},
    }


def _stage(
    module: nn.Module, stage: int, mesh: Any
) -> tuple[zeroshard.ZeroOptimizer, zeroshard.pipelining.PipelineStage]:
    """ZeRO over this pipeline stage's data-parallel group, and the stage."""
    optimizer = zeroshard.ZeroOptimizer(
        module.parameters(),
        "adamw",
        stage=stage,
        device_mesh=mesh["dp"],
        module=module,
        reduce_bucket_size=50,
        lr=LR,
    )
    pipeline_stage = zeroshard.pipelining.PipelineStage(
        module,
        mesh["pp"].get_local_rank(),
        PP,
        torch.device("cpu"),
        group=mesh["pp"].get_group(),
        optimizer=optimizer,
    )
    return optimizer, pipeline_stage


def _train(rank: int, world_size: int, stage: int, schedule_name: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_index, dp_index = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = make_stages()[pp_index]
    optimizer, pipeline_stage = _stage(module, stage, mesh)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = schedule_class(pipeline_stage, n_microbatches=MICRO, loss_fn=loss_fn)
    per = BATCH // DP
    reductions = []
    for step in range(STEPS):
        tokens, targets = batch(step)
        tokens, targets = (
            tokens[dp_index * per : (dp_index + 1) * per],
            targets[dp_index * per : (dp_index + 1) * per],
        )
        optimizer.zero_grad()
        optimizer.reset_comm_stats()
        if pp_index == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=[])
        during_schedule = optimizer.comm_stats()["reduce_scatter_bytes"]
        optimizer.step()
        reductions.append((during_schedule, optimizer.comm_stats()["reduce_scatter_bytes"]))
    with optimizer.gathered_parameters():
        params = {f"{pp_index}.{n}": p.detach().clone() for n, p in module.named_parameters()}
    return {
        "params": params,
        "reductions": reductions,
        "flat_bytes": 4 * optimizer._impl.shard_numel(0) * DP,  # fp32, one group
    }


@pytest.mark.parametrize(("stage", "schedule"), [(1, "gpipe"), (2, "gpipe"), (2, "1f1b")])
def test_zero_per_pipeline_stage_matches_torch_optim(stage: int, schedule: str) -> None:
    results = unwrap(run_ranks(WORLD, _train, stage, schedule))
    expected = reference()
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            diff = (value - expected[name]).abs().max().item()
            assert diff <= TOLERANCE, (rank, name, diff)
        worst = max((v - expected[n]).abs().max().item() for n, v in r["params"].items())
        print(f"stage {stage} {schedule} rank {rank}: max abs diff {worst:.3e}")
        for during, total in r["reductions"]:
            # Nothing reduced during the micro-batches; one reduction of the
            # whole (padded) flat gradient at step().
            assert during == 0, (rank, r["reductions"])
            assert total == r["flat_bytes"], (rank, total, r["flat_bytes"])


def _stage3(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_index = mesh["pp"].get_local_rank()
    module = make_stages()[pp_index]
    optimizer = zeroshard.ZeroOptimizer(
        module.parameters(), stage=3, device_mesh=mesh["dp"], module=module
    )
    zeroshard.pipelining.PipelineStage(
        module, pp_index, PP, torch.device("cpu"), group=mesh["pp"].get_group(), optimizer=optimizer
    )


def test_stage3_per_pipeline_stage_is_a_clear_error_on_every_rank() -> None:
    for r in run_ranks(WORLD, _stage3):
        assert isinstance(r, RankError) and r.type_name == "ValueError", r
        assert "stage 3 with pipeline parallelism is not supported yet" in r.message


def _train_tp(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    # PP 2 x TP 2 (DP 1): each stage's block MLP split Megatron-style.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import ScheduleGPipe
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (PP, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp_index = mesh["pp"].get_local_rank()
    module = make_stages()[pp_index]
    plan = {"block.mlp_in": ColwiseParallel(), "block.mlp_out": RowwiseParallel()}
    parallelize_module(module, mesh["tp"], plan)
    optimizer, pipeline_stage = _stage(module, stage, mesh)
    schedule = ScheduleGPipe(pipeline_stage, n_microbatches=MICRO, loss_fn=loss_fn)
    for step in range(STEPS):
        tokens, targets = batch(step)
        optimizer.zero_grad()
        if pp_index == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=[])
        optimizer.step()
    full = optimizer.full_state_dict(rank=0)
    return {"params": {f"{pp_index}.{n}": v for n, v in full.items()}}


@pytest.mark.parametrize("stage", [1, 2])
def test_tensor_parallel_inside_pipeline_stages_matches_torch_optim(stage: int) -> None:
    # The schedule divides .grad by the micro-batch count after the last
    # backward; the DTensor parameters' local gradients (which zeroshard
    # moved off .grad) must be divided too (PipelineStage.scale_grads).
    expected = reference()
    for rank, r in enumerate(unwrap(run_ranks(WORLD, _train_tp, stage))):
        worst = max((v - expected[n]).abs().max().item() for n, v in r["params"].items())
        print(f"PP 2 x TP 2 stage {stage} rank {rank}: max abs diff {worst:.3e}")
        assert worst <= TOLERANCE, (rank, worst)
