"""A training job for torchrun that checkpoints every few steps and resumes
from ``latest`` when restarted (test_checkpoint.py runs it with
``--max-restarts 1``).

    torchrun --nproc-per-node 2 --max-restarts 1 resume_job.py SAVE_DIR OUT [KILL_STEP]

With KILL_STEP, rank 1 kills itself (SIGKILL) at that step on the first
attempt only. Rank 0 writes the final fp32 weights to OUT.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "python"))

import zeroshard  # noqa: E402

from tiny_models import SEQ, VOCAB, make_gpt  # noqa: E402

STEPS, EVERY, BATCH = 12, 3, 12


def main() -> None:
    save_dir, out = sys.argv[1], sys.argv[2]
    kill_step = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_gpt(seed=0, width=16, hidden=24)
    engine, optimizer, _, _ = zeroshard.initialize(
        model=model,
        config={
            "train_batch_size": BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    first = 0
    if (Path(save_dir) / "latest").exists():
        _, client_state = engine.load_checkpoint(save_dir)
        first = client_state["next_step"]
        if rank == 0:
            print(f"resumed at step {first}", flush=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(first, STEPS):
        if step == kill_step and rank == 1 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(50_000 + step)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        per_rank = BATCH // world
        tokens = tokens[rank * per_rank : (rank + 1) * per_rank]
        logits = engine(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1))
        engine.backward(loss)
        engine.step()
        if (step + 1) % EVERY == 0:
            engine.save_checkpoint(save_dir, client_state={"next_step": step + 1})
    full = optimizer.full_state_dict(rank=0)
    if rank == 0:
        torch.save(full, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
