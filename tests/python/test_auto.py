"""``"auto"`` stage and offload devices: the estimator's cheapest configuration that fits.

On this CPU-only machine the device is the host, so a configuration fits when
its device bytes for both ranks plus its host bytes fit the node's budget
(``memory_limit`` per rank x 2 here, far below what is free, so the limit
decides). The expected choices are derived from ``zeroshard.estimate``'s
figures for the same model, in the order the seed documents advise: stages
1, 2, 3 first, offload last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import zeroshard

from dist_harness import run_ranks, unwrap

WIDTH, LAYERS, WORLD = 64, 16, 2
SUB_GROUP = 1000
# No stage 3 prefetch: with the default window (5e7 elements) this small a
# model stays gathered whole, and stage 3 would need more than stage 2.
NO_PREFETCH = {"stage3_prefetch_bucket_size": 0}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def _need(stage: int, **offload: Any) -> float:
    """Per-node bytes of a configuration for this model, as 'auto' counts them."""
    total, largest = zeroshard.estimator.count_model(_model())
    row = zeroshard.estimate(
        total,
        largest_unit_params=largest,
        world_size=WORLD,
        ranks_per_node=WORLD,
        precision="fp32",
        stages=(stage,),
        prefetch_bucket_size=0,
        host_device=True,  # CPU tensors on Gloo, as the ranks run
        **offload,
    )[0]
    return row["device_bytes"] * WORLD + row["cpu_bytes_per_node"]


def _run(rank: int, world_size: int, zero: dict[str, Any], limit: float) -> dict[str, Any]:
    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {**NO_PREFETCH, **zero},
    }
    try:
        engine, optimizer, *_ = zeroshard.initialize(model, config=config, memory_limit=limit)
    except ValueError as error:
        return {"error": str(error)}
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, WIDTH, generator=g)[2 * rank : 2 * rank + 2]
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    zero_options = engine.config.optimizer_arguments()["zero_options"]
    return {
        "stage": engine.config.zero_stage,
        "offload_optimizer": zero_options["offload_optimizer"]["device"],
        "offload_param": zero_options["offload_param"]["device"],
        "losses": losses,
    }


def _choose(zero: dict[str, Any], node_budget: float) -> list[dict[str, Any]]:
    return unwrap(run_ranks(WORLD, _run, zero, node_budget / WORLD))


def test_auto_stage_is_the_first_that_fits(capfd) -> None:
    need = {stage: _need(stage) for stage in (1, 2, 3)}
    print(f"per-node needs: {need}")
    assert need[1] > need[2] > need[3]
    for expected, budget in ((1, need[1] * 1.01), (2, (need[1] + need[2]) / 2), (3, need[3])):
        for result in _choose({"stage": "auto"}, budget):
            assert "error" not in result, result
            assert (result["stage"], result["offload_optimizer"]) == (expected, "none")
            assert all(torch.isfinite(torch.tensor(result["losses"])))
        printed = capfd.readouterr().out
        assert f'zeroshard "auto" chose ZeRO stage {expected}: it needs' in printed, printed
        if expected > 1:
            assert "Rejected first: ZeRO stage 1 (needs" in printed, printed


def test_auto_offload_goes_to_nvme_only_when_stage_3_does_not_fit(tmp_path: Path) -> None:
    # NVMe saves memory only with sub-groups much smaller than a rank's shard:
    # buffer_count (4) of them stay in host memory.
    plain = _need(3)
    cpu = _need(3, offload_optimizer="cpu", sub_group_size=SUB_GROUP)
    nvme = _need(3, offload_optimizer="nvme", sub_group_size=SUB_GROUP)
    print(f"stage 3 per-node needs: none {plain:.0f}, cpu {cpu:.0f}, nvme {nvme:.0f}")
    # On a CPU device, offloading to the host adds staging to the same RAM.
    assert cpu > plain > nvme
    zero = {
        "stage": 3,
        "sub_group_size": SUB_GROUP,
        "offload_optimizer": {"device": "auto", "nvme_path": str(tmp_path)},
    }
    roomy = _choose(zero, plain * 1.01)
    tight = _choose(zero, (plain + nvme) / 2)
    for result in roomy:
        assert result["offload_optimizer"] == "none", result
    for result in tight:
        assert "error" not in result, result
        assert (result["stage"], result["offload_optimizer"]) == (3, "nvme"), result
    assert list(tmp_path.iterdir()) == []


def test_auto_names_what_is_short_on_every_rank() -> None:
    results = _choose({"stage": "auto", "offload_optimizer": {"device": "auto"}}, 20_000)
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result}")
        message = result["error"]
        assert 'zeroshard "auto" configuration for' in message
        assert "nothing fits: even ZeRO stage 3 + optimizer offload to cpu" in message
        assert "short of host memory by" in message
        assert "NVMe not tried: no nvme_path given" in message


# ---- Activations ----------------------------------------------------------------------

GPT2_SHAPE = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64, "n_positions": 64}


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**GPT2_SHAPE))


def test_activation_bytes_follow_korthikanti_for_a_gpt2_config() -> None:
    s, b, h, a, layers, vocab = 64, 2, 32, 2, 2, 64
    masks = 2 * s * b * h + a * s * s * b  # 1-byte dropout masks
    values = s * b * h * (34 + 5 * a * s / h) - masks
    fp32 = layers * (2 * values + masks) + s * b * vocab * (4 + 4)
    bf16 = layers * (values + masks) + s * b * vocab * (2 + 4)
    model = _gpt2()
    assert zeroshard.estimator.activation_bytes(model, b, s, precision="fp32") == fp32
    assert zeroshard.estimator.activation_bytes(model, b, s) == bf16
    # Checkpointing keeps each layer's input and one layer's full set.
    checkpointed = layers * s * b * h * 4 + (2 * values + masks) + s * b * vocab * 8
    got = zeroshard.estimator.activation_bytes(model, b, s, precision="fp32", checkpointing=True)
    assert got == checkpointed
    assert zeroshard.estimator.activation_bytes(nn.Linear(3, 3), b, s) is None  # no config


def _run_gpt2(rank: int, world_size: int, limit: float, sequence_length: int | None) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": "auto"},
    }
    engine, *_ = zeroshard.initialize(
        _gpt2(), config=config, memory_limit=limit, sequence_length=sequence_length
    )
    tokens = torch.randint(0, GPT2_SHAPE["vocab_size"], (2, 16))
    engine.backward(engine(tokens, labels=tokens).loss)
    engine.step()
    return engine.config.zero_stage


def test_auto_counts_activations_when_the_sequence_length_is_given(capfd) -> None:
    model = _gpt2()
    total, largest = zeroshard.estimator.count_model(model)
    rows = zeroshard.estimate(
        total,
        largest_unit_params=largest,
        world_size=WORLD,
        ranks_per_node=WORLD,
        precision="fp32",
        stages=(1, 2),
        host_device=True,
    )
    need = {r["stage"]: r["device_bytes"] * WORLD + r["cpu_bytes_per_node"] for r in rows}
    activations = zeroshard.estimator.activation_bytes(model, 2, 64, precision="fp32")
    assert activations is not None
    # Room for stage 1's model states, and for stage 2's plus activations only.
    budget = max(need[1] * 1.01, (need[1] + need[2]) / 2 + WORLD * activations)
    assert need[1] + WORLD * activations > budget > need[2] + WORLD * activations
    assert unwrap(run_ranks(WORLD, _run_gpt2, budget / WORLD, None)) == [1, 1]
    printed = capfd.readouterr().out
    assert "Activations are not counted: pass sequence_length=" in printed, printed
    assert unwrap(run_ranks(WORLD, _run_gpt2, budget / WORLD, 64)) == [2, 2]
    printed = capfd.readouterr().out
    assert f"Counted with {activations / 1e9:.3f} GB of activations per rank" in printed, printed
