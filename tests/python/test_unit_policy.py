"""Stage 3's default wrap policy on standard modules, against single-process torch.optim.

Models whose forward reads a child's parameters without calling the child
(``nn.MultiheadAttention`` reads ``out_proj.weight``; ``nn.TransformerEncoderLayer``
holds one) and Hugging Face models built from small configs (random init, no
download) train at stage 3 with no ``unit_classes``. The yardstick where
reduction order matters is DDP on the same ranks: 2 ranks sum two half-batch
gradients where the reference sums one batch, and Adam turns that rounding on
near-zero gradients into lr-sized steps; zeroshard must be no further from
the reference than DDP is.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.units import plan_units, resolve_unit_classes

from dist_harness import run_ranks, unwrap
from tiny_models import make_gpt, max_abs_diff, snapshot

VOCAB, SEQ, BATCH, STEPS, LR = 23, 6, 8, 10, 1e-2
TOLERANCE = 1e-6


class EncoderLM(nn.Module):
    """A language model around ``nn.TransformerEncoder`` (MHA inside each layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


class AttentionNet(nn.Module):
    """``nn.MultiheadAttention`` called directly by a parent with no parameters of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 12)
        self.attention = nn.MultiheadAttention(12, 3, batch_first=True)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        attended, _ = self.attention(x, x, x, need_weights=False)
        return self.head(self.norm(x + attended))


class LogitsOnly(nn.Module):
    """A transformers causal LM returning its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=SEQ,
    )
    config._attn_implementation = "eager"
    return LogitsOnly(LlamaForCausalLM(config))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    return LogitsOnly(GPT2LMHeadModel(config))


MODELS = {
    "transformer_encoder": EncoderLM,
    "multihead_attention": AttentionNet,
    "llama": _llama,
    "gpt2": _gpt2,
}


def _make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    per_rank = BATCH // world_size
    rows = tokens[rank * per_rank : (rank + 1) * per_rank]
    return rows[:, :-1], rows[:, 1:]


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _reference(name: str) -> dict[str, torch.Tensor]:
    return _reference_of(_make(name))


def _reference_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Single-process torch.optim on the global batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        _loss(model, *_batch(step, 0, 1)).backward()
        optimizer.step()
    return snapshot(model)


def _train(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        model = _make(name)
        optimizer = zeroshard.ZeroOptimizer(
            model.parameters(), "adamw", stage=3, module=model, lr=LR
        )
        for step in range(STEPS):
            optimizer.zero_grad()
            _loss(model, *_batch(step, rank, world_size)).backward()
            optimizer.step()
        with optimizer.gathered_parameters():
            params = snapshot(model)
        # The yardstick: DDP on the same ranks and batches.
        ddp_model = _make(name)
        ddp = nn.parallel.DistributedDataParallel(ddp_model)
        ddp_optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=LR)
        for step in range(STEPS):
            ddp_optimizer.zero_grad()
            _loss(ddp, *_batch(step, rank, world_size)).backward()
            ddp_optimizer.step()
        out[name] = {"zeroshard": params, "ddp": snapshot(ddp_model), "units": optimizer.units}
        out[name]["from_ddp"] = max_abs_diff(params, out[name]["ddp"])
    return out


_RESULTS: dict[int, list[dict[str, Any]]] = {}


def _trained(world_size: int) -> list[dict[str, Any]]:
    if world_size not in _RESULTS:
        pytest.importorskip("transformers")  # installed by scripts/ensure_env.sh
        _RESULTS[world_size] = unwrap(run_ranks(world_size, _train, list(MODELS), timeout=400))
    return _RESULTS[world_size]


@pytest.mark.parametrize("name", list(MODELS))
def test_stage3_default_policy_matches_torch_optim(name: str) -> None:
    results = _trained(2)
    expected = _reference(name)
    for rank, result in enumerate(results):
        diff = max_abs_diff(result[name]["zeroshard"], expected)
        ddp_diff = max_abs_diff(result[name]["ddp"], expected)
        print(
            f"{name} rank={rank}: units {result[name]['units']}; max abs diff from "
            f"single-process zeroshard {diff:.3e}, DDP {ddp_diff:.3e}; zeroshard from DDP "
            f"{result[name]['from_ddp']:.3e}"
        )
        assert diff <= max(TOLERANCE, ddp_diff), (name, rank, diff, ddp_diff)
    assert max_abs_diff(results[1][name]["zeroshard"], results[0][name]["zeroshard"]) == 0.0


# ---- The policy itself (no ranks needed) -----------------------------------------


def _unit_names(model: nn.Module, classes: tuple[type[nn.Module], ...] = ()) -> dict[str, int]:
    return {u.name: sum(p.numel() for p in u.params) for u in plan_units(model, classes)}


def test_default_policy_makes_repeated_layers_units_and_covers_children_read_by_a_parent() -> None:
    encoder = _unit_names(EncoderLM())
    assert list(encoder) == ["embed", "encoder.layers.0", "encoder.layers.1", "head"]
    layer = EncoderLM().encoder.layers[0]
    assert encoder["encoder.layers.0"] == sum(p.numel() for p in layer.parameters())

    attention = plan_units(AttentionNet())
    assert [u.name for u in attention] == ["embed", "attention", "norm", "head"]
    model = AttentionNet()
    units = {u.name: u for u in plan_units(model)}
    # out_proj is gathered with its parent, whose forward reads it.
    assert any(p is model.attention.out_proj.weight for p in units["attention"].params)

    # The root owns the position table: it covers every parameter outside the
    # blocks, the tied head once.
    gpt = make_gpt()
    assert _unit_names(gpt) == {"<root>": 144, "blocks.0": 300, "blocks.1": 300}


def test_unit_classes_replace_the_detection_and_blocks_do_not_nest() -> None:
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()
            self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    model = nn.Sequential(Outer(), Outer(), nn.Linear(2, 1))
    # Default: the repeated Outer layers are blocks; their expert lists stay inside.
    assert list(_unit_names(model)) == ["0", "1", "2"]
    # unit_classes: Inner only; the experts are units of their own.
    named = _unit_names(model, (Inner,))
    assert list(named) == [
        "0.inner",
        "0.experts.0",
        "0.experts.1",
        "0.experts.2",
        "1.inner",
        "1.experts.0",
        "1.experts.1",
        "1.experts.2",
        "2",
    ]
    assert resolve_unit_classes(model, ["Inner"]) == (Inner,)
    with pytest.raises(ValueError, match=r"names \['Nope'\].*module classes are \[.*'Outer'"):
        resolve_unit_classes(model, ["Nope"])


# ---- A parameter read outside its unit ------------------------------------------


class ReadsChildWeight(nn.Module):
    """Reads its child's weight without calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.inner.weight) + self.inner.bias


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.reader = ReadsChildWeight()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.reader(x)))


def _released_read(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    # Threshold 0: nothing stays gathered for being small.
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "sgd",
        stage=3,
        module=model,
        lr=0.1,
        stage3_param_persistence_threshold=0,
    )
    try:
        model(torch.ones(2, 4))
        failure: dict[str, Any] = {"raised": False}
    except RuntimeError as error:
        failure = {"raised": True, "notes": list(getattr(error, "__notes__", []))}
    # The config names the class to gather as one unit: the same model trains.
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zeroshard": {"unit_classes": ["ReadsChildWeight"]},
    }
    torch.manual_seed(0)
    model = Net()
    engine, *_ = zeroshard.initialize(model, config=config)
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    errors = {}
    for label, bad in {
        "unknown_class": {"zeroshard": {"unit_classes": ["ReadsChildWieght"]}},
        "not_stage3": {"zeroshard": {"unit_classes": ["Net"]}, "zero_optimization": {"stage": 2}},
        "not_a_list": {"zeroshard": {"unit_classes": "Net"}},
    }.items():
        try:
            zeroshard.initialize(Net(), config={**config, **bad})
            errors[label] = None
        except ValueError as error:
            errors[label] = str(error)
    del optimizer
    dist.barrier()
    return {"failure": failure, "units": engine.optimizer.units, "errors": errors}


def test_a_released_parameter_read_names_the_parameter_and_the_module_to_make_a_unit() -> None:
    for result in unwrap(run_ranks(2, _released_read)):
        failure = result["failure"]
        assert failure["raised"]
        text = "\n".join(failure["notes"])
        print(text)
        assert "'reader' (ReadsChildWeight)" in text
        assert "'reader.inner.weight' (unit 'reader.inner')" in text
        assert "unit_classes=(ReadsChildWeight, ...)" in text
        assert result["units"] == ["reader", "out"]
        errors = result["errors"]
        assert "names ['ReadsChildWieght']" in errors["unknown_class"]
        assert "stage 3 setting" in errors["not_stage3"]
        assert "must be a list of module class names" in errors["not_a_list"]


# ---- Mixture of experts: ranks route to different experts ------------------------


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class SparseMoeBlock(nn.Module):
    """Top-1 routing: which experts run depends on the tokens, so on a rank's
    half of the batch some experts get no token and never run."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            mask = choice == index
            if mask.any():
                out[mask] = expert(flat[mask]) * weight[mask, None]
        return x + out.reshape(x.shape)


class MoeLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.moe = SparseMoeBlock(8, 4)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(tokens)))


def _make_moe() -> nn.Module:
    torch.manual_seed(3)
    return MoeLM()


def _moe_train(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"experts_idle": 0}
    for stage in (1, 2, 3):
        model = _make_moe()
        extra = {"module": model} if stage == 3 else {}
        optimizer = zeroshard.ZeroOptimizer(
            model.parameters(), "adamw", stage=stage, lr=LR, **extra
        )
        for step in range(STEPS):
            optimizer.zero_grad()
            tokens, targets = _batch(step, rank, world_size)
            with torch.no_grad():
                routed = model.moe.gate(model.embed(tokens)).argmax(-1).unique().numel()
            out["experts_idle"] += 4 - routed
            _loss(model, tokens, targets).backward()
            optimizer.step()
        with optimizer.gathered_parameters():
            out[stage] = snapshot(model)
        out[f"units_{stage}"] = optimizer.units
    ddp_model = _make_moe()
    ddp = nn.parallel.DistributedDataParallel(ddp_model, find_unused_parameters=True)
    ddp_optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=LR)
    for step in range(STEPS):
        ddp_optimizer.zero_grad()
        _loss(ddp, *_batch(step, rank, world_size)).backward()
        ddp_optimizer.step()
    out["ddp"] = snapshot(ddp_model)
    return out


def test_moe_with_experts_idle_on_some_ranks_trains_at_every_stage() -> None:
    results = unwrap(run_ranks(2, _moe_train))
    expected = _reference_of(_make_moe())
    # Some experts got no token on some rank at some step: the case that hangs
    # DeepSpeed ZeRO-3 and that FSDP2 does not support.
    assert sum(r["experts_idle"] for r in results) > 0
    for rank, result in enumerate(results):
        # The MoE block is one unit (gate and all experts), recognised by name.
        assert result["units_3"] == ["embed", "moe", "head"], result["units_3"]
        ddp_diff = max_abs_diff(result["ddp"], expected)
        for stage in (1, 2, 3):
            diff = max_abs_diff(result[stage], expected)
            print(
                f"MoE stage {stage} rank {rank}: max abs diff from single-process {diff:.3e}, "
                f"DDP {ddp_diff:.3e}; idle expert-steps {result['experts_idle']}"
            )
            assert diff <= max(TOLERANCE, ddp_diff), (stage, rank, diff, ddp_diff)
