"""Hugging Face Trainer with zeroshard: a small GPT-2 (built from a config, no
download) trained on synthetic tokens by ``ZeroTrainer``.

    torchrun --nproc_per_node 2 examples/hf_trainer_gpt2.py --stage 3
    torchrun --nproc_per_node 2 examples/hf_trainer_gpt2.py --resume out/checkpoint-10

The DeepSpeed-style config's "auto" values come from the TrainingArguments,
as with ``TrainingArguments(deepspeed=...)``. Checkpoints (``--save-steps``)
resume at any world size or stage; the final model is saved with
``save_pretrained`` and loads with ``GPT2LMHeadModel.from_pretrained``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from zeroshard.integrations.hf import ZeroTrainer


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.tokens = torch.randint(
            0, vocab, (n, length), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--offload-optimizer", default="none", choices=["none", "cpu"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--output-dir", default="out/hf_trainer_gpt2")
    opts = parser.parse_args()
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=4, n_head=4)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=opts.output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=opts.steps,
        warmup_steps=2,
        logging_steps=5,
        save_steps=opts.save_steps,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    zero_config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {
            "stage": opts.stage,
            "offload_optimizer": {"device": opts.offload_optimizer},
        },
    }
    trainer = ZeroTrainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(512, 64, config.vocab_size),
        zeroshard_config=zero_config,
    )
    trainer.train(resume_from_checkpoint=opts.resume)
    trainer.save_model(f"{opts.output_dir}/final")  # collective: every rank calls it


if __name__ == "__main__":
    main()
