"""The on-device update is torch.optim's single-tensor path, op for op.

On CPU it runs over L2-sized pieces of the shard, a range of pieces per
thread ([Note: cache-sized update chunks] in csrc/optim/inner_optimizer.cpp).
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
