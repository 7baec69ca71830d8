"""A Hugging Face Trainer job for test_hf_trainer.py, run by torchrun (or plain
python for the single-process reference).

    python hf_trainer_job.py OUT --trainer plain|zero [--stage N] [--offload cpu]
        [--max-steps N] [--save-steps N] [--resume CHECKPOINT] [--save-model DIR]
        [--evaluate] [--generate]

A tiny GPT-2 (from a config, no download) trains on a fixed synthetic set with
AdamW, max_grad_norm=1, accumulation 2 and a global batch of 8 sequences
whatever the world size. Rank 0 writes OUT/result.json (the logged grad
norms, losses and learning rates, what trainer.model_wrapped is) and
OUT/params.pt (the full final weights).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "..", "..", "..", "python")]

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

GLOBAL_BATCH = 8
ACCUMULATION = 2
SEQ = 16
VOCAB = 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--trainer", choices=["plain", "zero"], required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--offload", default="none")
    parser.add_argument("--optimizer", default="AdamW", help='"none": no optimizer section')
    parser.add_argument("--optim", default=None, help="TrainingArguments.optim")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-model", default=None)
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--generate", action="store_true")
    parser.add_argument("--nan-at", type=int, default=-1, help="a NaN loss at this global step")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(
        output_dir=opts.out,
        per_device_train_batch_size=GLOBAL_BATCH // ACCUMULATION // world,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=5e-3,
        weight_decay=0.1,
        max_grad_norm=1.0,
        max_steps=opts.max_steps,
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=1,
        save_strategy="steps" if opts.save_steps else "no",
        save_steps=opts.save_steps or 500,
        seed=0,
        data_seed=0,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        **({"optim": opts.optim} if opts.optim else {}),
    )
    model = make_model()
    common = {"model": model, "args": args, "train_dataset": Tokens(), "eval_dataset": Tokens(12)}
    if opts.trainer == "zero":
        from zeroshard.integrations.hf import ZeroTrainer, full_model_state_dict

        zero: dict = {"stage": opts.stage, "stage3_param_persistence_threshold": 0}
        if opts.offload != "none":
            zero["offload_optimizer"] = {"device": opts.offload}

        config = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "optimizer": {"type": opts.optimizer, "params": {"lr": "auto", "weight_decay": "auto"}},
            "zero_optimization": zero,
        }
        if opts.optimizer == "none":  # TrainingArguments.optim decides
            del config["optimizer"]
        if opts.nan_at >= 0:  # skip steps with non-finite gradients
            config["bf16"] = {"enabled": "auto", "check_grad_overflow": True}
        nan_at = opts.nan_at

        class NanAt(ZeroTrainer):
            def compute_loss(self, model, inputs, *args, **kwargs):  # noqa: ANN001, ANN002
                loss = super().compute_loss(model, inputs, *args, **kwargs)
                return loss * float("nan") if self.state.global_step == nan_at else loss

        trainer = NanAt(**common, zeroshard_config=config)
    else:
        trainer = Trainer(**common)
    trainer.train(resume_from_checkpoint=opts.resume)
    result: dict = {
        "log": [e for e in trainer.state.log_history if "loss" in e],
        "wrapped": type(trainer.model_wrapped).__name__,
        "global_step": trainer.state.global_step,
        "lr": trainer.lr_scheduler.get_last_lr(),
    }
    if opts.trainer == "zero":  # what each group runs, with what
        result["inner"] = trainer.zero_optimizer._kind  # optimizer= (a name, or a class's)
        result["groups"] = [
            [
                g["optimizer"].__name__ if "optimizer" in g else "",
                len(g["params"]),
                g["weight_decay"],
            ]
            for g in trainer.zero_optimizer.param_groups
        ]
    if opts.evaluate:
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
    if opts.generate:
        rank = dist.get_rank() if dist.is_initialized() else 0
        # Different lengths on each rank: rank r stops after 2 + 3r new tokens.
        prompt = torch.tensor([[1, 2, 3]])
        out = model.generate(
            prompt, max_new_tokens=2 + 3 * rank, min_new_tokens=2 + 3 * rank, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        result["generated"] = out.shape[1] - prompt.shape[1]
    if opts.save_model:
        trainer.save_model(opts.save_model)
    if opts.trainer == "zero":
        state = full_model_state_dict(model, trainer.zero_optimizer)
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(state, os.path.join(opts.out, "params.pt"))
        with open(os.path.join(opts.out, "result.json"), "w") as f:
            json.dump(result, f)
    if opts.generate and dist.is_initialized():
        # Every rank's count, for the test to see each stopped at its own length.
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, result["generated"])
        if dist.get_rank() == 0:
            with open(os.path.join(opts.out, "generated.json"), "w") as f:
                json.dump(counts, f)
    # End as docs/python-api.md's "Shutting down" says: drop what holds the
    # process group (the trainer, accelerate's DDP wrapper, the optimizer; at
    # stage 3 the model's hooks), then destroy it, so that Gloo's threads are
    # joined now. The plain-Trainer reference left its group to interpreter
    # exit and once aborted there on one rank ("terminate called without an
    # active exception").
    del trainer, model, common
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
