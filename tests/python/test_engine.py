"""zeroshard.initialize: DeepSpeed's config, mixed precision, loss scaling, telemetry.

Mixed-precision runs are compared with a single-process reference that uses
the same recipe (16-bit model, fp32 master weights and AdamW state, the loss
multiplied by the same scale and the gradients divided by it).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap
from tiny_models import SEQ, VOCAB, make_gpt

STEPS = 8
ACCUMULATION = 2
GLOBAL_BATCH = 12  # per micro-batch, divisible by 2, 3 and 4
LR = 1e-2
SEED_CONFIG = os.path.join(os.path.dirname(__file__), "data", "seed_zero3_config.json")


def config(dtype: torch.dtype, stage: int, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH * ACCUMULATION,
        "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 0.0,
        "steps_per_print": 4,
        # A scale the tiny model's gradients never overflow at, so that the
        # reference and the ranks take the same steps.
        "fp16": {"enabled": dtype == torch.float16, "initial_scale_power": 8},
        "bf16": {"enabled": dtype == torch.bfloat16},
    }
    out.update(extra)
    return out


def batch(step: int, micro: int, rank: int, world_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(30_000 + 100 * step + micro)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    per_rank = GLOBAL_BATCH // world_size
    return tokens[rank * per_rank : (rank + 1) * per_rank]


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # Predict each token from itself through the causal model: a stable target.
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens.reshape(-1))


def reference(dtype: torch.dtype, scale: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The mixed-precision recipe in one process on the global batch."""
    model = make_gpt(seed=0).to(dtype)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(master, lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUMULATION):
            tokens = batch(step, micro, 0, 1)
            loss = loss_of(model(tokens), tokens)
            (loss * (scale / ACCUMULATION)).backward()
            total += loss.item() / ACCUMULATION
        for p, m in zip(params, master, strict=True):
            m.grad = p.grad.float() / scale
            p.grad = None
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, master, strict=True):
                p.copy_(m)
        losses.append(total)
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, (m.detach() for m in master), strict=True)), losses


def _train(rank: int, world_size: int, dtype: torch.dtype, stage: int) -> dict[str, Any]:
    model = make_gpt(seed=0).to(dtype)
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=config(dtype, stage))
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUMULATION):
            tokens = batch(step, micro, rank, world_size)
            loss = loss_of(engine(tokens), tokens)
            engine.backward(loss)
            engine.step()
            total += loss.item() / ACCUMULATION
        losses.append(total)
    return {
        "master": optimizer.full_state_dict(rank=0),
        "losses": losses,
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scale,
        "global_steps": engine.global_steps,
        "telemetry": engine.last_telemetry(),
    }


# Gradients are summed across ranks in the 16-bit format, where the reference
# computes one 16-bit gradient of the whole batch: the two differ by rounding
# (a few units in the last place of each gradient element, 2^-11 relative in
# fp16, 2^-8 in bf16), which Adam's normalisation passes on to the updates.
# Measured after 8 steps at stages 1-3: fp16 5.2e-5 to 6.2e-5, bf16 6.8e-4 to
# 9.5e-4 (losses 5e-5 to 1.4e-3 apart); the bounds leave ~5x room.
_MASTER_TOLERANCE = {torch.float16: 3e-4, torch.bfloat16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_matches_the_single_process_recipe(dtype, stage) -> None:
    world_size = 2
    results = unwrap(run_ranks(world_size, _train, dtype, stage))
    scale = 2.0**8 if dtype == torch.float16 else 1.0
    expected, expected_losses = reference(dtype, scale)
    r = results[0]
    assert r["skipped"] == 0 and r["global_steps"] == STEPS
    assert r["scale"] == scale
    diff = max((r["master"][k] - v).abs().max().item() for k, v in expected.items())
    # Each rank's loss is the mean over its equal slice: their mean is the global loss.
    losses = [sum(x["losses"][i] for x in results) / world_size for i in range(STEPS)]
    loss_diff = max(abs(a - b) for a, b in zip(losses, expected_losses, strict=True))
    print(
        f"stage {stage} {dtype}: master weights max abs diff {diff:.2e} (bound "
        f"{_MASTER_TOLERANCE[dtype]}), loss diff {loss_diff:.2e}"
    )
    assert diff <= _MASTER_TOLERANCE[dtype]
    assert loss_diff <= 5e-3
    assert losses[-1] < losses[0]  # it learns


def _loss_curve(rank: int, world_size: int, dtype: torch.dtype) -> list[float]:
    return _train(rank, world_size, dtype, 2)["losses"]


def test_bf16_loss_curve_follows_fp32() -> None:
    fp32 = unwrap(run_ranks(2, _loss_curve, torch.float32))[0]
    bf16 = unwrap(run_ranks(2, _loss_curve, torch.bfloat16))[0]
    gaps = [abs(a - b) / a for a, b in zip(fp32, bf16, strict=True)]
    print(f"fp32 {fp32}\nbf16 {bf16}\nrelative gaps {gaps}")
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4%); measured
    # gaps stay under 0.6% over 8 steps.
    assert max(gaps) <= 0.02


# ---- Overflow handling --------------------------------------------------------------


def _overflow(
    rank: int, world_size: int, stage: int, min_scale_case: bool, offload: bool = False
) -> dict[str, Any]:
    model = make_gpt(seed=0).to(torch.float16)
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    if min_scale_case:
        fp16.update({"initial_scale_power": 1, "min_loss_scale": 1})
    cfg = config(torch.float16, stage, fp16=fp16)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=cfg)
    poison = {"on": False}

    def inject(grad: torch.Tensor) -> torch.Tensor:
        # Only rank 1 sees an inf, in one parameter's gradient.
        return grad * math.inf if poison["on"] and rank == 1 else grad

    model.blocks[0].mix.weight.register_hook(inject)
    events = []
    for step in range(4):
        poison["on"] = step == 2 or (min_scale_case and step >= 1)
        before = optimizer.full_state_dict(rank=0)  # collective; empty off rank 0
        shard_before = optimizer.state_dict()["zeroshard_shard"]
        scale_before = engine.loss_scale
        for micro in range(ACCUMULATION):
            tokens = batch(step, micro, rank, world_size)
            engine.backward(loss_of(engine(tokens), tokens))
            engine.step()
        after = optimizer.full_state_dict(rank=0)
        unchanged = all(torch.equal(before[k], after[k]) for k in before) if rank == 0 else None
        # This rank's optimizer state (with offload: the host master and moments).
        shard_after = optimizer.state_dict()["zeroshard_shard"]
        state_unchanged = all(torch.equal(shard_before[k], shard_after[k]) for k in shard_before)
        events.append(
            (
                step,
                scale_before,
                engine.loss_scale,
                engine.skipped_steps,
                unchanged,
                state_unchanged,
            )
        )
    return {"events": events}


@pytest.mark.parametrize(
    ("stage", "offload"),
    [(2, False), (3, False), (2, True), (3, True)],
    ids=["stage2", "stage3", "stage2_offload", "stage3_offload_params_too"],
)
def test_an_inf_on_one_rank_skips_the_step_everywhere_and_halves_the_scale(stage, offload) -> None:
    results = unwrap(run_ranks(2, _overflow, stage, False, offload))
    for rank, r in enumerate(results):
        for step, before, after, skipped, unchanged, state_unchanged in r["events"]:
            print(f"rank {rank} step {step}: scale {before} -> {after}, skipped {skipped}")
            if step == 2:
                assert after == before / 2 and skipped == 1
                assert state_unchanged, "a skipped step changed the optimizer state"
                if rank == 0:
                    assert unchanged, "a skipped step changed the parameters"
            elif step < 2:
                assert after == before and skipped == 0
                if rank == 0:
                    assert not unchanged


def test_reaching_the_minimum_loss_scale_is_a_clear_error_on_every_rank() -> None:
    results = run_ranks(2, _overflow, 2, True)
    for result in results:
        message = getattr(result, "message", "")
        print(message)
        assert "Current loss scale already at minimum" in message, result


# ---- Config ---------------------------------------------------------------------


def _initialize_error(rank: int, world_size: int, cfg: Any) -> str:
    try:
        zeroshard.initialize(model=make_gpt(seed=0), config=cfg)
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


_BASE = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
CONFIG_ERRORS = {
    "batch_mismatch": (
        {**_BASE, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1},
        "train_batch_size (8) != train_micro_batch_size_per_gpu (3) * "
        "gradient_accumulation_steps (1) * world_size (2) = 6",
    ),
    "unknown_top_level_key": (
        {**_BASE, "zero_optimisation": {"stage": 2}},
        'unknown key "zero_optimisation" in the config; did you mean "zero_optimization"?',
    ),
    "unknown_zero_key": (
        {**_BASE, "zero_optimization": {"stage": 3, "stage3_prefetch_bucketsize": 10}},
        'did you mean "stage3_prefetch_bucket_size"?',
    ),
    "nvme_param_offload_needs_a_path": (
        {**_BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        'zero_optimization.offload_param.nvme_path is needed with device "nvme"',
    ),
    "nvme_offload_needs_a_path": (
        {**_BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
        'zero_optimization.offload_optimizer.nvme_path is needed with device "nvme"',
    ),
    "param_offload_below_stage3": (
        {**_BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "offloads parameter shards, which needs ZeRO stage 3",
    ),
    "bad_stage_type": (
        {**_BASE, "zero_optimization": {"stage": "three"}},
        "zero_optimization.stage must be an integer",
    ),
    "fp16_and_bf16": (
        {**_BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "fp16",
    ),
}


@pytest.mark.parametrize("name", list(CONFIG_ERRORS))
def test_config_errors_are_clear_on_every_rank(name: str) -> None:
    cfg, expected = CONFIG_ERRORS[name]
    for message in unwrap(run_ranks(2, _initialize_error, cfg)):
        print(message)
        assert expected in message


def test_the_seed_zero3_config_loads_unchanged() -> None:
    # seeds/002 section 4.2, verbatim: 1024 = 8 per GPU x 16 accumulation x 8 GPUs.
    parsed = zeroshard._C.load_deepspeed_config(SEED_CONFIG, 8)
    assert (parsed.train_batch_size, parsed.zero_stage) == (1024, 3)
    # It asks for CPU offload of the optimizer state and the parameters: supported.
    assert list(parsed.unsupported) == []
    parsed.check_supported()


def _train_seed_config(rank: int, world_size: int, offload: bool) -> dict[str, Any]:
    with open(SEED_CONFIG) as f:
        cfg = json.load(f)
    # Only the batch numbers adapted: 8 per rank x 16 micro-batches x world size.
    cfg["train_batch_size"] = 8 * 16 * world_size
    if not offload:  # the yardstick: the same config with the state on the device
        del cfg["zero_optimization"]["offload_optimizer"], cfg["zero_optimization"]["offload_param"]
    model = make_gpt(seed=0)
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=cfg)
    for step in range(3):
        for micro in range(16):
            g = torch.Generator().manual_seed(50_000 + 100 * step + micro)
            tokens = torch.randint(0, VOCAB, (8 * world_size, SEQ), generator=g)
            local = tokens[8 * rank : 8 * (rank + 1)]
            engine.backward(loss_of(engine(local), local))
            engine.step()
    return {
        "master": optimizer.full_state_dict(rank=0),
        "host_bytes": optimizer.host_model_state_bytes(),
        "global_steps": engine.global_steps,
    }


def test_the_seed_zero3_config_with_cpu_offload_trains() -> None:
    moved = unwrap(run_ranks(2, _train_seed_config, True))
    plain = unwrap(run_ranks(2, _train_seed_config, False))[0]
    for r in moved:
        assert r["global_steps"] == 3
        assert r["host_bytes"] > 0, "state was offloaded to host memory"
    diff = max((moved[0]["master"][k] - v).abs().max().item() for k, v in plain["master"].items())
    initial = dict(make_gpt(seed=0).named_parameters(remove_duplicate=False))
    moved_from_start = max(
        (v - initial[k].detach()).abs().max().item() for k, v in moved[0]["master"].items()
    )
    print(f"offloaded vs on-device master: {diff:.3e}; moved from init by {moved_from_start:.3e}")
    assert moved_from_start > 1e-5, "the parameters were trained"
    assert diff <= 1e-6


# ---- Schedule and telemetry ---------------------------------------------------------


def _telemetry(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model = make_gpt(seed=0)
    cfg = config(
        torch.float32,
        2,
        steps_per_print=2,
        zeroshard={"telemetry_file": path},
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4},
        },
    )
    engine, optimizer, _, scheduler = zeroshard.initialize(model=model, config=cfg)
    lrs = []
    for step in range(6):
        for micro in range(ACCUMULATION):
            tokens = batch(step, micro, rank, world_size)
            engine.backward(loss_of(engine(tokens), tokens))
            engine.step()
        lrs.append(scheduler.get_last_lr()[0])
    tracked = (
        optimizer.parameter_bytes() + optimizer.gradient_bytes() + optimizer.optimizer_state_bytes()
    )
    return {
        "lrs": lrs,
        "tracked": tracked,
        "telemetry": engine.last_telemetry(),
        "batch": (engine.train_batch_size(), engine.gradient_accumulation_steps()),
        "global_steps": engine.global_steps,
    }


def test_telemetry_lines_parse_and_agree_with_tracked_bytes(tmp_path) -> None:
    path = str(tmp_path / "telemetry.jsonl")
    results = unwrap(run_ranks(2, _telemetry, path))
    records = [json.loads(line) for line in open(path)]
    print(records[-1])
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in results:
        assert r["batch"] == (GLOBAL_BATCH * ACCUMULATION, ACCUMULATION)
        assert r["global_steps"] == 6
        line = r["telemetry"]["line"]
        fields = dict(item.split("=") for item in line.split())
        assert set(fields) >= {
            "step", "loss", "lr", "loss_scale", "skipped", "forward_ms", "backward_ms",
            "optimizer_ms", "comm_wait", "model_states_MiB", "peak_rss_MiB",
        }  # fmt: skip
        assert r["telemetry"]["model_state_bytes"] == r["tracked"]
        assert 0.0 <= r["telemetry"]["comm_wait_share"] <= 1.0
    assert records[-1]["model_state_bytes"] == results[0]["tracked"]
    # WarmupLR, log warmup over 4 steps (DeepSpeed's formula), then flat.
    expected = [LR * math.log(s + 1) / math.log(4) if s < 4 else LR for s in range(6)]
    print("lrs", results[0]["lrs"], "expected", expected)
    assert results[0]["lrs"] == pytest.approx(expected, rel=1e-9, abs=1e-12)


def _telemetry_after_resets(rank: int, world_size: int) -> dict[str, Any]:
    model = make_gpt(seed=0)
    cfg = config(torch.float32, 2, steps_per_print=2, wall_clock_breakdown=True)
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=cfg)
    optimizer.reset_comm_stats()  # construction's broadcast is before telemetry's start
    per_step = []
    records = []
    for step in range(6):
        for micro in range(ACCUMULATION):
            tokens = batch(step, micro, rank, world_size)
            engine.backward(loss_of(engine(tokens), tokens))
            engine.step()
        per_step.append(optimizer.comm_stats())
        # A user's reset (a public, documented call) after every step: the
        # telemetry keeps counters of its own and must not notice.
        optimizer.reset_comm_stats()
        if step % 2 == 1:
            records.append(engine.last_telemetry())
    return {
        "records": records,
        "per_step": per_step,
        "numel": sum(p.numel() for p in model.parameters()),
    }


def test_telemetry_reports_bytes_sent_and_ignores_a_users_counter_reset() -> None:
    world_size = 2
    results = unwrap(run_ranks(world_size, _telemetry_after_resets))
    share = (world_size - 1) / world_size
    for r in results:
        for stats in r["per_step"]:
            # Whole buffers, and what a rank sends of them by the ring count.
            assert stats["wire_bytes"] == pytest.approx(
                share
                * (
                    2 * stats["all_reduce_bytes"]
                    + stats["reduce_scatter_bytes"]
                    + stats["all_gather_bytes"]
                    + stats["broadcast_bytes"]
                ),
                rel=1e-12,
            )
            # Stage 2, fp32: a reduce-scatter of the 4-byte gradients per
            # micro-batch and one all-gather of the parameters a step, each
            # sending 4Ψ(N-1)/N (padding to the world size adds a little; the
            # step's flags all-reduce comes on top).
            formula = (ACCUMULATION + 1) * 4 * r["numel"] * share
            sent = share * (stats["reduce_scatter_bytes"] + stats["all_gather_bytes"])
            assert formula <= sent <= 1.05 * formula, (sent, formula)
        for i, record in enumerate(r["records"]):
            print(record["line"])
            window = r["per_step"][2 * i : 2 * i + 2]
            sent = sum(stats["wire_bytes"] for stats in window) / 2
            assert record["comm_mib_per_step"] * 1048576 == pytest.approx(sent, rel=1e-9)
            assert 0.0 <= record["comm_wait_share"] <= 1.0, record
            assert "comm_MiB_per_step=" in record["line"]


def _bf16_options(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, extra in (
        ("bf16_reduce", {}),
        ("fp32_reduce", {"communication_data_type": "fp32"}),
    ):
        model = make_gpt(seed=0).to(torch.bfloat16)
        engine, optimizer, _, _ = zeroshard.initialize(
            model=model, config=config(torch.bfloat16, 2, **extra)
        )
        out[label] = optimizer.gradient_bytes()  # the gradient shard, allocated
    # bf16 with the non-finite check set to raise: an inf on rank 1 stops every rank.
    model = make_gpt(seed=0).to(torch.bfloat16)
    cfg = config(
        torch.bfloat16,
        2,
        bf16={"enabled": True, "check_grad_overflow": True},
        zeroshard={"on_nonfinite": "raise"},
    )
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    model.blocks[0].mix.weight.register_hook(lambda g: g * math.inf if rank == 1 else g)
    try:
        for micro in range(ACCUMULATION):
            tokens = batch(0, micro, rank, world_size)
            engine.backward(loss_of(engine(tokens), tokens))
            engine.step()
        out["error"] = "no error"
    except RuntimeError as error:
        out["error"] = str(error)
    return out


def test_bf16_reduction_dtype_and_raising_on_non_finite_gradients() -> None:
    for r in unwrap(run_ranks(2, _bf16_options)):
        print(r)
        # communication_data_type fp32: the gradient shard is fp32, twice the bytes.
        assert r["fp32_reduce"] == 2 * r["bf16_reduce"]
        assert "on_nonfinite" in r["error"] and "inf or NaN" in r["error"]
