"""An Accelerate training loop for test_accelerate.py, run by torchrun (or
plain python for the single-process reference).

    python accelerate_job.py OUT --optimizer torch|zero [--stage N]
        [--steps N] [--save-at K] [--resume DIR]

The tiny GPT-2 of hf_trainer_job.py, AdamW (lr 5e-3, weight decay 0.1),
clipping at 1.0 through accelerator.clip_grad_norm_, accumulation 2 through
accelerator.accumulate, a global batch of 8. With --save-at K the state is
saved with accelerator.save_state(OUT/state) after step K; --resume DIR
loads it with accelerator.load_state and trains the remaining steps. Rank 0
writes OUT/result.json (norms, wrapped type) and OUT/params.pt.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "..", "..", "..", "python"), _HERE]

from accelerate import Accelerator  # noqa: E402

from hf_trainer_job import ACCUMULATION, GLOBAL_BATCH, Tokens, make_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--optimizer", choices=["torch", "zero"], required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", default=None)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True)
    world = accelerator.num_processes
    model = make_model().to(accelerator.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    loader = torch.utils.data.DataLoader(
        Tokens(), batch_size=GLOBAL_BATCH // ACCUMULATION // world, shuffle=False
    )
    if opts.optimizer == "zero":
        import zeroshard
        from zeroshard.integrations.accelerate import prepare

        optimizer = zeroshard.ZeroOptimizer(
            groups, "adamw", stage=opts.stage, module=model if opts.stage == 3 else None,
            stage3_param_persistence_threshold=0, lr=5e-3,
        )  # fmt: skip
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
    else:
        optimizer = torch.optim.AdamW(groups, lr=5e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # Stepped once per optimizer step at any world size (accelerate's prepared
    # scheduler steps once per process), and saved with the state.
    accelerator.register_for_checkpointing(scheduler)
    first = 0
    if opts.resume:
        accelerator.load_state(opts.resume)
        first = opts.save_at
    norms, step = [], 0
    batches = iter(loader)
    for _ in range(first * ACCUMULATION):  # the data the saved steps consumed
        next(batches)
    while step < opts.steps - first:
        batch = next(batches)
        with accelerator.accumulate(model):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # accelerate's idiom: clip whole gradients
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            scheduler.step()
            norms.append(float(norm))
            step += 1
            if opts.save_at and not opts.resume and first + step == opts.save_at:
                accelerator.save_state(os.path.join(opts.out, "state"))
    if opts.optimizer == "zero":
        from zeroshard.integrations import unwrap_optimizer
        from zeroshard.integrations.hf import full_model_state_dict

        state = full_model_state_dict(accelerator.unwrap_model(model), unwrap_optimizer(optimizer))
    else:
        state = {
            k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()
        }
    if accelerator.is_main_process:
        torch.save(state, os.path.join(opts.out, "params.pt"))
        with open(os.path.join(opts.out, "result.json"), "w") as f:
            json.dump({"norms": norms, "wrapped": type(model).__name__}, f)
    # end_training() destroys the process group; what holds it (the DDP
    # wrapper, the optimizer, at stage 3 the model's hooks) goes first, so
    # that Gloo's threads are joined then and not at interpreter exit (see
    # hf_trainer_job.py).
    accelerator.free_memory()
    accelerator._custom_objects.clear()  # the scheduler, registered for checkpointing
    del model, optimizer, scheduler, loader, batches
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
