"""Ordinary operations on a stage-3 model between steps: they work with real
values or raise a clear error; none crashes the process.

Before [Note: a released parameter refuses reads], ``p.clone()``,
``model.state_dict()`` values, ``copy.deepcopy(model)`` and a DDP wrap ended
in SIGSEGV (``nullptr + offset`` read by kernels that skip ATen's
allocation check), and ``model.to(torch.bfloat16)`` raised torch's
"data is not allocated yet ... torch.compile". Each operation runs in
processes of its own (tests/python/scripts/stage3_between_steps.py) so that a
signal shows as the exit code.
"""

from __future__ import annotations

import os

import pytest

from rank_processes import last_json, run_rank_processes

SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "scripts", "stage3_between_steps.py"
)

# Operations that cannot have full values on one rank: a clear error.
REFUSED = {
    "clone": "Tensor.clone",
    "state_dict_read": "Tensor.detach",
    "deepcopy": "copy.deepcopy",
    "to_dtype": "Tensor.to",
    "ddp_wrap": "Tensor.detach",
    "safetensors": "Tensor.detach",
    "torch_save": "pickling",
}


def _run(op: str) -> list[dict]:
    results = []
    for rank, (code, out) in enumerate(run_rank_processes(SCRIPT, [op], world=2)):
        # A negative code is a signal (SIGSEGV was -11).
        assert code == 0, f"{op}: rank {rank} exited with {code}:\n{out}"
        results.append(last_json(out))
    return results


@pytest.mark.parametrize("op", sorted(REFUSED))
def test_reads_of_released_parameters_raise_a_clear_error(op: str) -> None:
    for rank, result in enumerate(_run(op)):
        assert result["outcome"] == "error", f"{op} rank {rank}: {result}"
        message = result["message"]
        assert result["type"] == "RuntimeError", (op, rank, result)
        assert message.startswith("zeroshard: "), (op, rank, message)
        assert REFUSED[op] in message, (op, rank, message)  # what was refused
        assert "cannot read parameter '" in message, (op, rank, message)  # which parameter
        assert "gathered_parameters()" in message and "full_state_dict()" in message, message


def test_a_move_that_changes_nothing_keeps_training() -> None:
    # model.to("cpu:0"), .cpu(), .float() on a CPU fp32 model: the released
    # parameters answer with themselves, and the step goes on updating them.
    for rank, result in enumerate(_run("move_then_train")):
        assert result["outcome"] == "ok", (rank, result)
        assert result["moved"] > 1e-4, (rank, result)  # the step changed the weights
        assert result["off_master"] == 0.0, (rank, result)  # the model shows the optimizer's


def test_metadata_of_released_parameters_is_readable() -> None:
    for rank, result in enumerate(_run("metadata")):
        assert result["outcome"] == "ok", (rank, result)
        assert result["numel"] > 0 and len(result["shape"]) >= 1, result  # full shapes
        assert result["dtype"] == "torch.float32" and result["device"] == "cpu", result
        assert result["repr_says_released"] and result["module_repr"], result


def test_gathered_parameters_give_the_full_values() -> None:
    for rank, result in enumerate(_run("gathered_clone")):
        assert result["outcome"] == "ok", (rank, result)
        assert result["off_master"] == 0.0, (rank, result)
