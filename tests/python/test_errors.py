"""Bad input: a clear error on every rank, never a hang.

Each scenario runs on both ranks of one Gloo group; after all of them the
group must still work (a final all-reduce), which shows no rank was left
inside a collective.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard

from dist_harness import RankError, run_ranks


def _one_parameter_in_two_groups() -> None:
    p = nn.Parameter(torch.ones(3))
    zeroshard.ZeroOptimizer([{"params": [p]}, {"params": [p]}])


def _non_leaf_tensor() -> None:
    p = nn.Parameter(torch.ones(3))
    zeroshard.ZeroOptimizer([p * 2])


def _mixed_dtypes_in_a_group() -> None:
    zeroshard.ZeroOptimizer(
        [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, dtype=torch.float64))]
    )


def _mixed_devices() -> None:
    zeroshard.ZeroOptimizer(
        [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, device="meta"))]
    )


def _integer_parameter() -> None:
    zeroshard.ZeroOptimizer([torch.ones(3, dtype=torch.int64)])


def _sparse_gradient() -> None:
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = zeroshard.ZeroOptimizer(embedding.parameters(), "sgd", lr=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    optimizer.step()


def _unsupported_stage() -> None:
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3))], stage=4)


def _meta_parameters_below_stage3() -> None:
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3, device="meta"))], stage=2)


def _stage3_without_module() -> None:
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3))], stage=3)


def _model_of_a_destroyed_stage3_optimizer() -> None:
    # The first optimizer leaves the 64x64 weight partitioned (released: its
    # storage emptied) when it goes; reading it again used to crash.
    model = nn.Sequential(nn.Linear(64, 64))
    first = zeroshard.ZeroOptimizer(
        model.parameters(), stage=3, module=model, stage3_param_persistence_threshold=0
    )
    del first
    zeroshard.ZeroOptimizer(model.parameters(), stage=3, module=model)


def _unknown_optimizer() -> None:
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3))], optimizer="adamax")


def _unknown_hyperparameter() -> None:
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3))], optimizer="sgd", betas=(0.9, 0.9))


def _misspelled_zero_option() -> None:
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3))], overlap_com=False)


def _negative_learning_rate() -> None:
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3))], lr=-1e-3)


def _negative_learning_rate_set_later() -> None:
    p = nn.Parameter(torch.ones(3))
    optimizer = zeroshard.ZeroOptimizer([p], lr=1e-3)
    p.grad = torch.ones(3)
    optimizer.param_groups[0]["lr"] = -0.5
    optimizer.step()


def _fused_sgd() -> None:
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3))], "sgd", fused=True)


def _different_parameters_per_rank() -> None:
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3 + dist.get_rank()))])


def _bad_dtype_on_rank_one_only() -> None:
    dtype = torch.float64 if dist.get_rank() == 1 else torch.float32
    zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, dtype=dtype))])


def _add_param_group_after_construction() -> None:
    optimizer = zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3))])
    optimizer.add_param_group({"params": [nn.Parameter(torch.ones(2))]})


def _not_a_zeroshard_state_dict() -> None:
    p = nn.Parameter(torch.ones(3))
    optimizer = zeroshard.ZeroOptimizer([p])
    optimizer.load_state_dict(torch.optim.AdamW([p]).state_dict())


# name: (scenario, expected exception type, words the message must contain,
# or per rank {rank: words})
SCENARIOS: dict[str, tuple[Callable[[], None], str, str | dict[int, str]]] = {
    "one_parameter_in_two_groups": (
        _one_parameter_in_two_groups,
        "ValueError",
        "more than one parameter group",
    ),
    "non_leaf_tensor": (_non_leaf_tensor, "ValueError", "non-leaf"),
    "mixed_dtypes": (
        _mixed_dtypes_in_a_group,
        "ValueError",
        "all parameters of a group must share one dtype",
    ),
    "mixed_devices": (_mixed_devices, "ValueError", "all parameters must be on one device"),
    "integer_parameter": (_integer_parameter, "ValueError", "floating-point parameters"),
    "sparse_gradient": (_sparse_gradient, "ValueError", "sparse gradient"),
    "unsupported_stage": (_unsupported_stage, "ValueError", "unsupported ZeRO stage 4"),
    "meta_below_stage3": (
        _meta_parameters_below_stage3,
        "ValueError",
        "only stage 3 materializes meta parameters",
    ),
    "stage3_without_module": (_stage3_without_module, "ValueError", "stage 3 needs module="),
    "model_of_a_destroyed_stage3_optimizer": (
        _model_of_a_destroyed_stage3_optimizer,
        "ValueError",
        "It is partitioned by a stage 3 ZeroOptimizer (one since destroyed",
    ),
    "unknown_optimizer": (_unknown_optimizer, "ValueError", "unknown optimizer 'adamax'"),
    "unknown_hyperparameter": (_unknown_hyperparameter, "TypeError", "['betas']"),
    # A ZeRO option spelled wrong lands among the inner optimizer's keywords:
    # the message points at the option, not only at Adam's hyper-parameters.
    "misspelled_zero_option": (
        _misspelled_zero_option,
        "TypeError",
        "['overlap_com'] for ZeroOptimizer with optimizer 'adamw' ('overlap_com': did you "
        "mean 'overlap_comm'?)",
    ),
    "negative_lr": (_negative_learning_rate, "ValueError", "Invalid learning rate: -0.001"),
    "negative_lr_set_later": (
        _negative_learning_rate_set_later,
        "ValueError",
        "Invalid learning rate: -0.5",
    ),
    "fused_sgd": (_fused_sgd, "ValueError", "fused=True is available for Adam and AdamW"),
    "different_parameters_per_rank": (
        _different_parameters_per_rank,
        "RuntimeError",
        "ranks built different partition layouts",
    ),
    # Only rank 1 is wrong: rank 0 must fail too instead of waiting for it.
    "bad_dtype_on_one_rank": (
        _bad_dtype_on_rank_one_only,
        "ValueError",
        {
            0: "another rank failed to construct its ZeroOptimizer",
            1: "all parameters of a group must share one dtype",
        },
    ),
    "add_param_group_late": (
        _add_param_group_after_construction,
        "RuntimeError",
        "cannot add parameter groups after construction",
    ),
    "not_a_zeroshard_state_dict": (
        _not_a_zeroshard_state_dict,
        "ValueError",
        "not a zeroshard.ZeroOptimizer state dict",
    ),
}


def _run_all_scenarios(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    outcomes: dict[str, tuple[str, str]] = {}
    for name, (scenario, _, _) in SCENARIOS.items():
        try:
            scenario()
            outcomes[name] = ("no error", "")
        except Exception as error:  # noqa: BLE001 - recorded for the assertions
            outcomes[name] = (type(error).__name__, str(error))
    alive = torch.ones(1)
    dist.all_reduce(alive)
    outcomes["group_still_works"] = ("ok" if alive.item() == world_size else "broken", "")
    return outcomes


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, tuple[str, str]]]:
    results = run_ranks(2, _run_all_scenarios)
    for result in results:
        assert not isinstance(result, RankError), result
    return results


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bad_input_raises_a_clear_error_on_every_rank(outcomes, name: str) -> None:
    _, expected_type, expected_words = SCENARIOS[name]
    for rank, result in enumerate(outcomes):
        error_type, message = result[name]
        print(f"rank {rank} {name}: {error_type}: {message}")
        words = expected_words[rank] if isinstance(expected_words, dict) else expected_words
        assert error_type == expected_type, (rank, error_type, message)
        assert words in message, (rank, message)


def test_a_rank_that_did_not_fail_names_the_one_that_did(outcomes) -> None:
    # Construction agrees on every rank's message (error_agreement.h): rank 0,
    # whose arguments were fine, is told which rank failed and why.
    _, message = outcomes[0]["bad_dtype_on_one_rank"]
    assert "rank 1: " in message, message
    assert "all parameters of a group must share one dtype" in message, message


def test_group_is_usable_after_every_error(outcomes) -> None:
    assert all(result["group_still_works"][0] == "ok" for result in outcomes)


def test_no_process_group_and_torch_distributed_not_initialised() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="call torch.distributed.init_process_group"):
        zeroshard.ZeroOptimizer([nn.Parameter(torch.ones(3))])
