"""DeepSpeed's ``"optimizer": {"type": "Muon"}`` through zeroshard.initialize (issue #47).

DeepSpeed runs it as MuonWithAuxAdam: the hidden matrices with Muon, the
rest (embeddings, head, biases, norms) with Adam. The engine splits the
groups the same way ([Note: DeepSpeed's Muon] in optimizer_config.cpp) and
must train as single-process ``torch.optim.Muon`` (Nesterov, the "original"
lr adjustment: DeepSpeed's muon_update) + ``torch.optim.AdamW`` with the
config's values, on the same global batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.deepspeed_muon import muon_param_groups, uses_muon

from dist_harness import run_ranks, unwrap
from tiny_models import (
    GLOBAL_BATCH,
    VOCAB,
    assert_ranks_match_reference,
    local_batch,
    make_gpt,
    max_abs_diff,
    snapshot,
)

STEPS = 4
PARAMS = {
    "muon_lr": 2e-2,
    "adam_lr": 1e-2,
    "momentum": 0.9,
    "weight_decay": 0.01,
    "betas": [0.9, 0.98],
    "eps": 1e-8,
    "ns_method": "standard",
}


def _config(stage: int, **params: Any) -> dict[str, Any]:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "optimizer": {"type": "Muon", "params": {**PARAMS, **params}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 0.0,
    }


def _model() -> nn.Module:
    model = make_gpt(seed=0)
    # DeepSpeed's rule would give the token and position tables (2-D, named
    # wte/wpe, not "embed") to Muon: the attribute, as a DeepSpeed user sets
    # it, keeps them (and the head tied to wte) with Adam. The blocks' 2-D
    # weights have no attribute and go by the rule.
    model.wte.weight.use_muon = False
    model.wpe.use_muon = False
    return model


def _hidden(model: nn.Module) -> list[nn.Parameter]:
    return [
        p for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() == 2
    ]


def _single_process() -> dict[str, torch.Tensor]:
    model = _model()
    hidden = {id(p) for p in _hidden(model)}
    muon = torch.optim.Muon(
        _hidden(model),
        lr=PARAMS["muon_lr"],
        momentum=PARAMS["momentum"],
        weight_decay=PARAMS["weight_decay"],
        nesterov=True,
        adjust_lr_fn="original",
    )
    adamw = torch.optim.AdamW(
        [p for p in model.parameters() if id(p) not in hidden],
        lr=PARAMS["adam_lr"],
        betas=tuple(PARAMS["betas"]),
        eps=PARAMS["eps"],
        weight_decay=PARAMS["weight_decay"],
    )
    for step in range(STEPS):
        tokens, targets = local_batch(step, 0, 1)
        muon.zero_grad()
        adamw.zero_grad()
        logits = model(tokens, step)
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
        muon.step()
        adamw.step()
    return snapshot(model)


def _train(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    model = _model()
    engine, optimizer, _, _ = zeroshard.initialize(model, config=_config(stage))
    kinds = sorted(group["optimizer"].__name__ for group in optimizer.param_groups)
    for step in range(STEPS):
        tokens, targets = local_batch(step, rank, world_size)
        logits = engine(tokens, step)
        engine.backward(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)))
        engine.step()
    with optimizer.gathered_parameters():
        params = snapshot(model)
    owned = []
    for p in _hidden(model):
        start, end = optimizer.state_range(p)
        owned.append((start, end) == (0, p.numel()))
    return {"params": params, "kinds": kinds, "owned": owned}


@pytest.mark.parametrize("world_size,stage", [(2, 1), (2, 3), (3, 2)])
def test_the_engine_trains_deepspeed_muon_as_single_process_torch_muon_and_adamw(
    world_size: int, stage: int
) -> None:
    results = unwrap(run_ranks(world_size, _train, stage))
    assert results[0]["kinds"] == ["AdamW", "Muon"], results[0]["kinds"]
    # Every hidden matrix is owned whole by exactly one rank.
    owners = [sum(r["owned"][i] for r in results) for i in range(len(results[0]["owned"]))]
    assert owners == [1] * len(owners), owners
    # Muon orthogonalises in bf16: the ulps by which the ranks' mean gradient
    # differs from the global one can round differently there. test_muon.py
    # measures DDP on the same model at 6e-8 from single-process; 1e-6 holds.
    expected = _single_process()
    label = f"DeepSpeed Muon W={world_size} stage {stage}"
    print(f"{label}: {max(max_abs_diff(r['params'], expected) for r in results):.3e}")
    assert_ranks_match_reference([r["params"] for r in results], expected, 1e-6, label)


def test_the_split_follows_use_muon_and_deepspeeds_rule_and_group_overrides() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)
            self.lm_head = nn.Linear(4, 10, bias=False)
            self.conv = nn.Conv1d(2, 2, 3)

    net = Net()
    hyper = {
        "muon": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1},
        "adam": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-10, "weight_decay": 0.1},
        "adam_w_mode": False,
    }
    names = dict(net.named_parameters())
    assert uses_muon("proj.weight", names["proj.weight"])
    assert not uses_muon("embed_tokens.weight", names["embed_tokens.weight"])
    assert not uses_muon("lm_head.weight", names["lm_head.weight"])
    assert not uses_muon("proj.bias", names["proj.bias"])
    # A 3-D weight marked for Muon is refused, naming it and the fix.
    with pytest.raises(ValueError, match=r"conv\.weight has shape \(2, 2, 3\).*use_muon"):
        muon_param_groups(net, net.parameters(), hyper)
    net.conv.weight.use_muon = False
    groups = muon_param_groups(
        net,
        [
            {"params": [net.proj.weight, net.embed_tokens.weight], "weight_decay": 0.0},
            {"params": [net.proj.bias, net.lm_head.weight, net.conv.weight, net.conv.bias]},
        ],
        hyper,
    )
    summary = [
        (g["optimizer"].__name__, len(g["params"]), g["weight_decay"], g["lr"]) for g in groups
    ]
    # adam_w_mode false: torch.optim.Adam (coupled decay), as DeepSpeed's.
    assert summary == [("Muon", 1, 0.0, 0.02), ("Adam", 1, 0.0, 3e-4), ("Adam", 4, 0.1, 3e-4)]
    assert groups[0]["nesterov"] and groups[0]["adjust_lr_fn"] == "original"
    assert groups[1]["betas"] == (0.9, 0.95) and groups[1]["eps"] == 1e-10


def _config_error(rank: int, world_size: int, params: dict[str, Any]) -> str:
    try:
        zeroshard.initialize(make_gpt(seed=0), config=_config(1, **params))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "params,expected",
    [
        ({"per_head_muon": True}, "per_head_muon = true is not supported yet"),
        ({"ns_method": "svd"}, 'ns_method must be "gram" or "standard", got "svd"'),
        ({"momentum": 1.0}, "momentum must be in [0, 1), got 1.0"),
        ({"nesterov": False}, "nesterov"),
    ],
)
def test_muon_config_errors_are_clear_on_every_rank(params: dict[str, Any], expected: str) -> None:
    for message in unwrap(run_ranks(2, _config_error, params)):
        assert expected in message, message
