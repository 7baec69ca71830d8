"""A Lightning Trainer with zeroshard: a small GPT (built from a config, no
download) on synthetic tokens.

    torchrun --nproc_per_node 2 examples/lightning_gpt.py --stage 3              # CPUs or GPUs
    torchrun --nproc_per_node 2 examples/lightning_gpt.py --resume out/lightning_gpt/last.ckpt

``strategy="zeroshard_stage_N"`` (registered by importing
``zeroshard.integrations.lightning``) turns the AdamW of ``configure_optimizers``
into a ZeroOptimizer: no DDP, accumulation under ``no_sync``, clipping by the
global norm, and checkpoint directories (``ModelCheckpoint``) that resume at
any world size. At stage 3, ``configure_model`` builds the model on the meta
device and each rank materializes only its shards. At the end, rank 0 turns
the last checkpoint into one plain Lightning file (``model.ckpt``).
"""

from __future__ import annotations

import argparse
import math
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.integrations.lightning  # noqa: F401 - registers the strategy names
from zeroshard.integrations.lightning import convert_to_lightning_checkpoint

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 512, 64, 128, 4, 4


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in (q, k, v))
        attention = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        return self.head(self.norm(self.blocks(x)))


class LitGPT(pl.LightningModule):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: GPT | None = None

    def configure_model(self) -> None:
        # Under ZeroShardStrategy at stage 3 this runs on the meta device: the
        # ZeroOptimizer allocates each rank's shards and runs reset_parameters.
        if self.model is None:
            self.model = GPT()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        logits = self.model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup = 10
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(step / 500))
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--offload", action="store_true", help="optimizer state in CPU memory")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--precision",
        default="32-true",
        choices=["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"],
        help="-mixed: autocast over fp32 weights; -true: a 16-bit model, fp32 master weights",
    )
    parser.add_argument("--out", default="out/lightning_gpt")
    parser.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    opts = parser.parse_args()
    strategy = f"zeroshard_stage_{opts.stage}" + ("_offload" if opts.offload else "")
    if opts.offload and opts.stage == 1:
        raise SystemExit("--offload is registered for stages 2 and 3")
    gpu = torch.cuda.is_available()
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1"))
        // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        precision=opts.precision,
        max_steps=opts.steps,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_model_summary=False,
        callbacks=[
            pl.callbacks.ModelCheckpoint(dirpath=opts.out, save_last=True, every_n_train_steps=10)
        ],
    )
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (512, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(tokens, batch_size=4, shuffle=True)
    trainer.fit(LitGPT(), loader, ckpt_path=opts.resume)
    if trainer.is_global_zero:
        last = os.path.join(opts.out, "last.ckpt")
        convert_to_lightning_checkpoint(last, os.path.join(opts.out, "model.ckpt"))
        print(f"[lightning_gpt] {trainer.global_step} steps; {last} -> {opts.out}/model.ckpt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
