"""An Accelerate training loop with zeroshard: a small GPT-2 (from a config)
on synthetic tokens.

    torchrun --nproc_per_node 2 examples/accelerate_gpt2.py --stage 3        # CPUs or GPUs
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_gpt2.py  # GPUs

(On a host without GPUs, ``accelerate launch`` starts no multi-CPU job without
MPI; Accelerate runs multi-CPU under torchrun's environment.)

``zeroshard.integrations.accelerate.prepare`` replaces ``accelerator.prepare``
for the model and its optimizer: no DDP (zeroshard reduces the gradients),
``accelerator.accumulate`` skips communication on micro-steps,
``accelerator.clip_grad_norm_`` uses the global norm, and ``save_state`` /
``load_state`` write a zeroshard checkpoint that loads at any world size.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

import zeroshard
from zeroshard.integrations.accelerate import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--state-dir", default="out/accelerate_gpt2")
    parser.add_argument("--resume", action="store_true", help="load_state from --state-dir first")
    opts = parser.parse_args()
    # cpu=True makes Accelerate run multi-CPU under torchrun (else it expects GPUs).
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=4, n_head=4)
    )
    model.to(accelerator.device)  # before the optimizer: it adopts the parameters' storage
    optimizer = zeroshard.ZeroOptimizer(
        model.parameters(),
        "adamw",
        stage=opts.stage,
        module=model if opts.stage == 3 else None,
        lr=1e-3,
        weight_decay=0.01,
    )
    tokens = torch.randint(0, 512, (512, 64), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(tokens, batch_size=4, shuffle=True)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
    if opts.resume:
        accelerator.load_state(opts.state_dir)
    step = 0
    while step < opts.steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 5 == 0:
                    accelerator.print(f"step {step} loss {loss.item():.4f} grad norm {norm:.4f}")
                if step == opts.steps:
                    break
    accelerator.save_state(os.path.join(opts.state_dir))  # collective
    accelerator.end_training()


if __name__ == "__main__":
    main()
