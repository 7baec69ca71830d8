"""Rank program for test_stage3_between_steps.py: one ordinary operation on a
stage-3 model between steps, in a process of its own (a crash is a signal the
test sees in the exit code).

    python stage3_between_steps.py OP

Trains one step of a tiny GPT at stage 3 (every parameter released between
steps), then does OP and prints one JSON line: {"outcome": "ok", ...} with
what it checked, or {"outcome": "error", "type": ..., "message": ...}.

Run with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (env:// rendezvous).
"""

from __future__ import annotations

import copy
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "..", "..", "..", "python"), os.path.join(_HERE, "..")]

import zeroshard  # noqa: E402

from tiny_models import SEQ, VOCAB, make_gpt  # noqa: E402


def train_step(model: nn.Module, optimizer: zeroshard.ZeroOptimizer, step: int) -> float:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    optimizer.zero_grad()
    logits = model(tokens, step)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1))
    loss.backward()
    optimizer.step()
    return float(loss)


def full_values(optimizer: zeroshard.ZeroOptimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    with optimizer.gathered_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def op_clone(model, optimizer) -> dict[str, Any]:
    first = next(model.parameters())
    return {"value": float(first.clone().sum())}


def op_state_dict_read(model, optimizer) -> dict[str, Any]:
    state = model.state_dict()
    return {"value": float(next(iter(state.values())).float().sum())}


def op_deepcopy(model, optimizer) -> dict[str, Any]:
    twin = copy.deepcopy(model)
    return {"params": sum(p.numel() for p in twin.parameters())}


def op_to_dtype(model, optimizer) -> dict[str, Any]:
    model.to(torch.bfloat16)
    return {}


def op_ddp_wrap(model, optimizer) -> dict[str, Any]:
    wrapped = nn.parallel.DistributedDataParallel(model)
    return {"wrapped": type(wrapped).__name__}


def op_safetensors(model, optimizer) -> dict[str, Any]:
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        save_file(model.state_dict(), os.path.join(tmp, "model.safetensors"))
    return {}


def op_torch_save(model, optimizer) -> dict[str, Any]:
    torch.save(model, io.BytesIO())
    return {}


def op_move_then_train(model, optimizer) -> dict[str, Any]:
    # A move that changes nothing: the model must keep training, and its
    # values must be the optimizer's (no detached copy).
    before = full_values(optimizer, model)
    model.to("cpu:0")
    model.cpu()
    model.float()
    train_step(model, optimizer, 1)
    after = full_values(optimizer, model)
    moved = max((after[n] - before[n]).abs().max().item() for n in before)
    master = optimizer.full_state_dict(rank=dist.get_rank())
    off_master = max((after[n] - master[n]).abs().max().item() for n in after if n in master)
    return {"moved": moved, "off_master": off_master}


def op_metadata(model, optimizer) -> dict[str, Any]:
    # What sizes things: shape, numel, dtype, device, repr; all without values.
    p = next(model.parameters())
    text = repr(p)
    return {
        "numel": sum(q.numel() for q in model.parameters()),
        "shape": list(p.shape),
        "dtype": str(p.dtype),
        "device": str(p.device),
        "repr_says_released": "released" in text,
        "module_repr": len(repr(model)) > 0,
    }


def op_gathered_clone(model, optimizer) -> dict[str, Any]:
    full = full_values(optimizer, model)
    master = optimizer.full_state_dict(rank=dist.get_rank())
    return {
        "off_master": max((full[n] - master[n]).abs().max().item() for n in full if n in master)
    }


OPS: dict[str, Callable[[nn.Module, zeroshard.ZeroOptimizer], dict[str, Any]]] = {
    name[3:]: fn for name, fn in globals().items() if name.startswith("op_")
}


def main() -> None:
    op = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = make_gpt(seed=0)
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=3,
        module=model,
        stage3_param_persistence_threshold=0,
        lr=1e-2,
    )
    train_step(model, optimizer, 0)
    try:
        result = {"outcome": "ok", **OPS[op](model, optimizer)}
    except Exception as error:  # noqa: BLE001 - reported to the test
        result = {"outcome": "error", "type": type(error).__name__, "message": str(error)}
    print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
