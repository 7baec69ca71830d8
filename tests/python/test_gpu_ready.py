"""What a GPU run pays for, held on CPU: host syncs counted per step, host
knowledge over a host channel, aligned parameters, pre-divided 16-bit
gradients.

On CPU a ``.item()`` costs nothing, so a design that makes the host wait for
the device once per unit passes every CPU test and starves a GPU. zeroshard
counts each wait by reason wherever it happens ([Note: host syncs, counted]
in csrc/include/zeroshard/host_syncs.h); these tests hold the budget on that
count (docs/gpu.md): after warm-up, at most 2 per step at every stage, none
per unit or per bucket.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.host_channel import add_host_backend, has_host_backend

from dist_harness import run_ranks, unwrap
from test_zero3 import BATCH, CONFIGS, STEPS, loss_of, micro_batch, reference
from tiny_models import assert_ranks_match_reference, make_gpt, snapshot

BUDGET_PER_STEP = 2  # the step's flags read and one more (docs/gpu.md)
WARM_UP_STEPS = 2


def _syncs(optimizer: Any) -> int:
    return sum(optimizer.host_sync_counts().values())


def _count_per_step(
    rank: int, world_size: int, stage: int, dtype: torch.dtype, channel: str
) -> dict[str, Any]:
    model = make_gpt(seed=0).to(dtype)
    # Stage 3: every unit gathered and released (none stays whole), the most
    # agreements a step can make.
    options: dict[str, Any] = (
        {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    )
    if dtype != torch.float32:
        options["skip_nonfinite_steps"] = True  # the overflow flag: one read per step
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), "adamw", stage=stage, **options)
    if channel == "none":
        optimizer.set_host_channel(None)  # as an NCCL group with no host channel
    per_step = []
    counts_after_warm_up: dict[str, int] = {}
    for step in range(WARM_UP_STEPS + 3):
        before = _syncs(optimizer)
        if step == WARM_UP_STEPS:
            counts_after_warm_up = optimizer.host_sync_counts()
        optimizer.zero_grad()
        tokens, targets = micro_batch(step, 0, rank, world_size)
        loss_of(model, tokens, targets, step).float().backward()
        optimizer.step()
        per_step.append(_syncs(optimizer) - before)
    after = optimizer.host_sync_counts()
    reasons = {k: after[k] - counts_after_warm_up.get(k, 0) for k in after}
    return {
        "per_step": per_step[WARM_UP_STEPS:],
        "reasons": {k: v for k, v in reasons.items() if v},
        "units": optimizer._impl.num_units(),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_syncs_per_step_stay_within_the_budget(stage: int, dtype: torch.dtype) -> None:
    for rank, result in enumerate(unwrap(run_ranks(2, _count_per_step, stage, dtype, "own"))):
        print(f"stage {stage} {dtype} rank {rank}: {result}")
        assert max(result["per_step"]) <= BUDGET_PER_STEP, result
        # Only the step's one read of the inf/NaN flag (16-bit with
        # skip_nonfinite_steps); agreements and flags ride the host channel.
        expected = {"step_flags": 3} if dtype != torch.float32 else {}
        assert result["reasons"] == expected, result


def test_without_a_host_channel_stage3_pays_per_unit_and_the_counter_sees_it() -> None:
    # The same run with host data sent through the device (an NCCL group that
    # has no host channel): every agreement waits for the device, several per
    # unit per step (its forward's and its backward's gather at least). The
    # counter is what shows it on CPU.
    for result in unwrap(run_ranks(2, _count_per_step, 3, torch.float32, "none")):
        print(result)
        assert min(result["per_step"]) >= 2 * result["units"] > 0, result
        assert set(result["reasons"]) == {"host_data_on_device"}, result


def _train_over_channel(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    channel = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    model = make_gpt(seed=0)
    _, _, hyper, _, _, _ = CONFIGS["gpt_adamw"]
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(), "adamw", stage=3, module=model, lr=1e-2, **hyper
    )
    optimizer.set_host_channel(channel)
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens, targets = micro_batch(step, 0, rank, world_size)
        loss_of(model, tokens, targets, step).backward()
        optimizer.step()
    assert _syncs(optimizer) == 0, optimizer.host_sync_counts()
    with optimizer.gathered_parameters():
        return snapshot(model)


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage3_with_agreements_on_a_host_channel_of_its_own_matches_torch_optim(
    world_size: int,
) -> None:
    # The channel is a second Gloo group: agreements travel there, gathers and
    # reductions on the shard group, in one order on every rank.
    assert BATCH % world_size == 0
    per_rank = unwrap(run_ranks(world_size, _train_over_channel))
    assert_ranks_match_reference(
        per_rank, reference("gpt_adamw"), 1e-6, f"stage 3 host channel world {world_size}"
    )


def _device_only_group(rank: int, world_size: int) -> dict[str, Any]:
    # A group with a backend for CUDA tensors only, as an NCCL group is: no
    # host tensors until zeroshard gives it a Gloo backend for them.
    store = dist.PrefixStore("device_only", dist.distributed_c10d._get_default_store())
    group = dist.ProcessGroup(store, rank, world_size)
    backend = dist.ProcessGroupGloo(
        dist.PrefixStore("gloo", store), rank, world_size, datetime.timedelta(seconds=60)
    )
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    before = has_host_backend(group)
    added = add_host_backend(group, store=store)
    again = add_host_backend(group, store=store)
    flags = torch.tensor([rank + 1])
    dist.all_reduce(flags, group=group)
    return {"before": before, "added": added, "again": again, "sum": int(flags)}


def test_a_group_without_a_host_backend_gets_one() -> None:
    for result in unwrap(run_ranks(2, _device_only_group)):
        assert result == {"before": False, "added": True, "again": False, "sum": 3}, result


# ---- [Note: aligned slots] ---------------------------------------------------


class _OddSizes(nn.Module):
    """Parameters of 3, 5, 7, 35, ... elements: packed at any offset, every
    one after the first odd one would start misaligned."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7).to(dtype)
        self.odd = nn.Parameter(torch.randn(3, dtype=dtype))
        self.b = nn.Linear(7, 5).to(dtype)
        self.c = nn.Linear(5, 1, bias=True).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))) + self.odd.sum()))


def _misaligned(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [f"{n} at {t.data_ptr() % 16}" for n, t in tensors.items() if t.data_ptr() % 16]


def _alignment(rank: int, world_size: int, stage: int, dtype: torch.dtype) -> list[str]:
    torch.manual_seed(0)
    model = _OddSizes(dtype)
    extra = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer(model.parameters(), "adamw", stage=stage, **extra)
    bad: list[str] = []
    seen: list[str] = []

    prefixes = {id(m): name for name, m in model.named_modules()}

    def check(module: nn.Module, _: Any) -> None:
        # Stage 3: the parameters as the forward sees them, just gathered.
        prefix = prefixes[id(module)]
        params = {f"{prefix}.{n}": p for n, p in module.named_parameters(recurse=False)}
        seen.extend(params)
        bad.extend(_misaligned(params))

    hooks = [m.register_forward_pre_hook(check) for m in model.modules()]
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 5, dtype=dtype)).float().sum().backward()
        optimizer.step()
        if stage < 3:
            bad.extend(_misaligned(dict(model.named_parameters())))
    for hook in hooks:
        hook.remove()
    assert len(set(seen)) == len(list(model.parameters())), seen
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_parameter_starts_on_a_16_byte_boundary(stage: int, dtype: torch.dtype) -> None:
    for rank, bad in enumerate(unwrap(run_ranks(3, _alignment, stage, dtype))):
        assert bad == [], f"rank {rank}: misaligned {bad}"


# ---- [Note: pre-divided 16-bit gradients] ----------------------------------


def _fp16_sum_overflows(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    # Each rank's gradient is 40000 (fp16's largest finite value is 65504):
    # the sum over 2 or 3 ranks overflows, their mean does not.
    weight = nn.Parameter(torch.ones(16, dtype=torch.float16))
    model = nn.Module()
    model.weight = weight
    extra = {"module": model} if stage == 3 else {}
    optimizer = zeroshard.ZeroOptimizer([weight], "sgd", stage=stage, lr=1e-5, **extra)
    optimizer.zero_grad()
    (weight * torch.full((16,), 40000.0, dtype=torch.float16)).sum().backward()
    optimizer.step()
    with optimizer.gathered_parameters():
        return {"weight": weight.detach().float().clone()}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_gradients_whose_sum_overflows_average_to_a_finite_step(
    world_size: int, stage: int
) -> None:
    # Single process on the global batch: the mean gradient is 40000, the
    # step 1e-5 x 40000 = 0.4 (rounded to fp16 through the fp32 master).
    expected = torch.tensor(1.0 - 0.4, dtype=torch.float16).float()
    for rank, result in enumerate(unwrap(run_ranks(world_size, _fp16_sum_overflows, stage))):
        weight = result["weight"]
        assert torch.isfinite(weight).all(), (rank, weight)
        assert torch.equal(weight, expected.expand(16)), (rank, weight)


# ---- Scale without the GPUs: torch's fake process group --------------------


def _fake_world(world: int, tmp_path: Any) -> list[dict[str, Any]]:
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / f"fake_{world}.json"
    script = Path(__file__).parent / "scripts" / "fake_world_job.py"
    subprocess.run([sys.executable, str(script), str(world), str(out)], check=True, timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", [8, 64])
def test_stages_at_fake_world_sizes_hold_what_the_estimator_says(world: int, tmp_path) -> None:
    # One process is the last rank of `world` (torch's fake group: collectives
    # move nothing). Its shard is 1/world of the padded flat buffer, its
    # optimizer state 12 bytes (fp32 master, m, v) per shard element, its
    # model states the estimator's figure plus the layout's padding (less
    # than world x 8 elements a bucket: [Note: aligned slots]), and a step
    # still costs no more host syncs than the budget.
    for row in _fake_world(world, tmp_path):
        print(row)
        (shard,), (flat,) = row["shard_numel"], row["flat_numel"]
        assert shard * world == flat >= row["num_params"], row
        assert row["optimizer_state_bytes"] == 12 * shard, row
        estimated = zeroshard.estimate(
            row["num_params"], world_size=world, precision="mixed16", stages=(row["stage"],)
        )[0]["model_state_bytes"]
        buckets = 5 if row["stage"] == 3 else 1  # stage 3: a bucket per Linear
        tensors = 10  # each slot starts aligned: a gap of less than 8 before each
        padding = buckets * world * 8 + tensors * 8  # elements, a bound
        padding_bytes = padding * (2 + 2 + 12)  # as parameter, gradient and state
        assert estimated <= row["model_state_bytes"] <= estimated + padding_bytes, (row, estimated)
        assert max(row["host_syncs_per_step"]) <= BUDGET_PER_STEP, row


def test_the_gpu_checks_fake_world_benchmark_runs(tmp_path) -> None:
    # scripts/gpu_check.sh runs it on a GPU with a 0.67B GPT; here a tiny GPT
    # on CPU keeps it working between GPU runs (its figures mean nothing here).
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "fake_world.md"
    args = "--device cpu --width 32 --depth 2 --heads 2 --vocab 64 --context 16 --batch 2"
    subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_gpu_fake_world.py"), *args.split()]
        + ["--steps", "2", "--warm-up", "1", "--out", str(out)],
        check=True,
        timeout=300,
    )
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["variant"] for r in rows] == [
        "adamw_fused",
        "zeroshard_stage1",
        "zeroshard_stage2",
        "zeroshard_stage3",
        "fsdp2",
    ]
    for row in rows:
        assert row["step_ms"] > 0, row
        if row["variant"].startswith("zeroshard"):
            assert row["counted_syncs_per_step"] <= BUDGET_PER_STEP, row
    assert "| zeroshard_stage3 |" in out.read_text()
