"""The on-device update is torch.optim's single-tensor path, op for op.

On CPU it runs over L2-sized pieces of the shard, a range of pieces per
thread ([Note: cache-sized update chunks] in csrc/update_rules/inner_optimizer.cpp).
Elementwise ops give each element the same value whatever the pieces, so the
result must equal torch.optim's (foreach=False, the CPU default) exactly, for
shards of one piece and of many with a ragged last piece, on 1 and 2 threads.
"""

from __future__ import annotations

import pytest
import torch

from zeroshard import _C

CASES = {
    "adamw": ("adamw", {"lr": 1e-2, "weight_decay": 0.1}, torch.optim.AdamW),
    "adam_l2": ("adam", {"lr": 1e-2, "weight_decay": 0.05}, torch.optim.Adam),
    "adam": ("adam", {"lr": 3e-3}, torch.optim.Adam),
    "sgd_nesterov_l2": (
        "sgd",
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        torch.optim.SGD,
    ),
    "sgd_dampening": ("sgd", {"lr": 0.1, "momentum": 0.5, "dampening": 0.3}, torch.optim.SGD),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("numel", [1000, 32768 * 3 + 517])
@pytest.mark.parametrize("case", sorted(CASES))
def test_update_equals_torch_optim_single_tensor_exactly(case: str, numel: int, threads: int):
    name, hyper, reference_class = CASES[case]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(numel)
        initial = torch.randn(numel, generator=generator)
        reference = torch.nn.Parameter(initial.clone())
        reference_optimizer = reference_class([reference], foreach=False, **hyper)
        param = initial.clone()
        exp_avg = torch.zeros(numel)
        exp_avg_sq = torch.zeros(numel)
        momentum = torch.zeros(numel)
        adam = name != "sgd"
        for step in range(1, 6):
            grad = torch.randn(numel, generator=generator) * 10.0 ** (step - 3)
            reference.grad = grad.clone()
            reference_optimizer.step()
            _C.inner_update(
                name,
                hyper,
                param,
                grad,
                exp_avg if adam else torch.Tensor(),
                exp_avg_sq if adam else torch.Tensor(),
                torch.Tensor() if adam else momentum,
                step,
            )
        assert torch.equal(param, reference.detach()), (
            f"max diff {(param - reference.detach()).abs().max().item():.3g}"
        )
        if adam:
            state = reference_optimizer.state[reference]
            assert torch.equal(exp_avg, state["exp_avg"])
            assert torch.equal(exp_avg_sq, state["exp_avg_sq"])
    finally:
        torch.set_num_threads(previous)


# ---- 16-bit gradient shards larger than one widening chunk -------------------------

WIDE = (1 << 22) * 2 + 4099  # a rank's shard spans three kShardChunkElements pieces


class _Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(2 * WIDE, generator=generator).bfloat16())

    def forward(self, coefficients: torch.Tensor) -> torch.Tensor:
        return (self.weight * coefficients).float().sum()


def _coefficients(step: int) -> torch.Tensor:
    # bf16 values, the same on both ranks: their sum, halved, is exact, so the
    # averaged gradient is exactly these values.
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * WIDE, generator=generator).bfloat16()


def _train_wide(
    rank: int, world_size: int, stage: int, max_norm: float | None
) -> torch.Tensor | None:
    import zeroshard

    model = _Wide()
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=stage,
        lr=1e-3,
        weight_decay=0.1,
        max_norm=max_norm,
        **({"module": model} if stage == 3 else {}),
    )
    for step in range(3):
        optimizer.zero_grad()
        model(_coefficients(step)).backward()
        optimizer.step()
    full = optimizer._impl.full_parameters(0)  # gathered on rank 0
    return full[0][0] if rank == 0 else None


@pytest.mark.parametrize("max_norm", [None, 0.5])
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_gradient_shards_widened_a_chunk_at_a_time_equal_torch_optim(
    stage: int, max_norm: float | None
) -> None:
    # The step and the gradient norm widen a 16-bit gradient shard to fp32 a
    # chunk at a time instead of copying the whole shard (4 bytes per shard
    # element, the largest transient of a stage 3 step). The update is
    # elementwise, so the chunks give torch.optim's values exactly. Clipping
    # scales the bf16 gradient by the coefficient rounded to bf16 (as
    # zeroshard does) and sums the squares chunk by chunk, an order of its
    # own; the bound allows that order one ulp of the fp32 norm.
    from dist_harness import run_ranks, unwrap

    master = torch.nn.Parameter(_Wide().weight.detach().float())
    reference = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.1, foreach=False)
    for step in range(3):
        reference.zero_grad()
        grad = _coefficients(step)
        if max_norm is not None:
            norm = torch.linalg.vector_norm(grad.float())
            grad = grad * (max_norm / (norm + 1e-6)).clamp(max=1.0).bfloat16()
        master.grad = grad.float()
        reference.step()
    got = unwrap(run_ranks(2, _train_wide, stage, max_norm, timeout=300))[0]
    diff = (got - master.detach()).abs().max().item()
    print(f"stage {stage} max_norm {max_norm}: max abs diff {diff:.3e}")
    assert diff <= (0.0 if max_norm is None else 1e-6)
