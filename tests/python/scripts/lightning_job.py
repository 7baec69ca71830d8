"""A Lightning job for test_lightning.py, run by torchrun (or plain python for the
single-process reference).

    python lightning_job.py OUT '[{"name": "ddp", "api": "trainer", "strategy": "ddp"}, ...]'

Runs one after the other in the same processes (importing lightning costs
more than a run); each takes the keys of DEFAULTS below: api (trainer, fabric or
recipe: run_recipe's hand-written 16-bit training with fp32 masters),
strategy (auto, ddp, zeroshard_stage_N...), precision, epochs, save,
resume (a checkpoint), meta_build, clip_algorithm, expect_error (the run's
error, as every rank raised it, is its result), validate (Trainer.validate of
the checkpoint ``resume`` instead of fit: the result is the validation loss),
nan_at (the Trainer's loss is NaN at this global step), fit_twice (a second
trainer.fit with the same Trainer), save_onto_file (trainer.save_checkpoint to
the path of a file rank 0 wrote), config (ZeroShardStrategy(config=...)
instead of the registered name), optimizers (2: configure_optimizers returns
two), predict (trainer.predict after fit: the sum of this rank's predictions),
optimizer_class (a torch.optim class name configure_optimizers uses instead
of AdamW).

A tiny model (an embedding, two repeated residual blocks, a head, a
persistent buffer) trains on a fixed synthetic set with AdamW (weight decay
0.1), a per-step LinearLR schedule, gradient clipping at 1.0, accumulation 2
and a global batch of 8 sequences whatever the world size: 2 optimizer steps
per epoch. For each run rank 0 writes OUT/NAME/result.json (the losses, the
learning rate, the type of the strategy's model, the number of steps) and
OUT/NAME/params.pt (the full final parameters). ``save`` writes a checkpoint
at the end of every epoch (OUT/NAME/ckpts/epoch=E-step=S.ckpt, or
OUT/NAME/ckpts/step=S for Fabric).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "..", "..", "..", "python")]

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

GLOBAL_BATCH = 8
ACCUMULATION = 2
SAMPLES = 16  # two optimizer steps per epoch
VOCAB, WIDTH, SEQ = 17, 12, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, VOCAB)
        # An explicit device: stage 3's configure_model builds on the meta device.
        self.register_buffer("scale", torch.tensor(0.5, device="cpu"))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)) * self.scale)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def loader(world: int) -> torch.utils.data.DataLoader:
    """This rank's share of every global batch, in order: rank r takes samples
    r, r + world, ... (Lightning's own sampler for training shuffles)."""
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset(), num_replicas=world, rank=int(os.environ.get("RANK", "0")), shuffle=False
    )
    return torch.utils.data.DataLoader(
        dataset(), batch_size=GLOBAL_BATCH // ACCUMULATION // world, sampler=sampler
    )


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return torch.utils.data.TensorDataset(tokens, targets)


def loss_of(net: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    logits = net(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_optimizer(params: object, name: str = "AdamW") -> tuple[torch.optim.Optimizer, object]:
    cls = getattr(torch.optim, name)  # AdamW, or another class (optimizer_class)
    optimizer = cls(params, lr=5e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1.0, end_factor=0.25, total_iters=8
    )
    return optimizer, scheduler


class LitModel(pl.LightningModule):
    def __init__(self, meta_build: bool = False, nan_at: int = -1) -> None:
        super().__init__()
        self.meta_build = meta_build
        self.nan_at = nan_at  # a NaN loss at this global step
        self.net: Net | None = None if meta_build else make_net()
        # Owned by the LightningModule itself (at stage 3 a unit of its own),
        # read by training_step only, never by a forward.
        self.temperature: nn.Parameter | None = None
        if not meta_build:
            self.temperature = nn.Parameter(torch.empty(()))
            self.reset_parameters()
        self.losses: list[float] = []
        self.built_on: str | None = None
        self.wrapped = ""
        self.syncs: list[bool] = []
        self.optimizers_returned = 1
        self.optimizer_class = "AdamW"

    def reset_parameters(self) -> None:
        """Initializes the LightningModule's own parameter (stage 3 materializes
        a meta-built model module by module with these)."""
        assert self.temperature is not None
        with torch.no_grad():
            self.temperature.fill_(1.25)

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)  # materialization initializes in the same order
            self.net = Net()
            self.temperature = nn.Parameter(torch.empty(()))
            self.built_on = self.net.head.weight.device.type

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.net is not None
        loss = loss_of(self.net, batch) * self.temperature
        if self.global_step == self.nan_at:
            loss = loss * float("nan")
        self.losses.append(loss.item())
        self.wrapped = type(self.trainer.strategy.model).__name__
        zero = getattr(self.trainer.strategy, "zero_optimizer", None)
        if zero is not None:  # whether this micro-step's backward communicates
            self.syncs.append(bool(zero._impl.gradient_sync()))
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        assert self.net is not None
        self.log("val_loss", loss_of(self.net, batch) * self.temperature, sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.net is not None
        return self.net(batch[0]).float().sum() * self.temperature

    def configure_optimizers(self) -> object:
        optimizer, scheduler = make_optimizer(self.parameters(), self.optimizer_class)
        if self.optimizers_returned == 2:  # one optimizer per half of the model
            assert self.net is not None
            return [
                torch.optim.AdamW(self.net.parameters()),
                torch.optim.SGD([self.temperature], lr=0.1),  # type: ignore[list-item]
            ]
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _strategy(opts: argparse.Namespace, api: str) -> object:
    """The strategy of the run: ZeroShardStrategy(config=opts.config) when a
    config is given, else the one registered as ``opts.strategy`` in the
    Trainer's or Fabric's registry.

    At stage 3 every parameter is gathered and released
    (stage3_param_persistence_threshold 0): a tiny model's would otherwise all
    stay whole.
    """
    name = opts.strategy
    if not name.startswith("zeroshard") and opts.config is None:
        return name
    import zeroshard.integrations.lightning as trainer_strategies
    from zeroshard.integrations.lightning import fabric as fabric_strategies

    if opts.config is not None:
        module = trainer_strategies if api == "trainer" else fabric_strategies
        return module.ZeroShardStrategy(config=opts.config)
    if "stage_3" not in name:
        return name
    if api == "trainer":
        strategy = pl.strategies.StrategyRegistry.get(name)
    else:
        from lightning.fabric.strategies import STRATEGY_REGISTRY

        strategy = STRATEGY_REGISTRY.get(name)
    strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return strategy


def run_trainer(opts: argparse.Namespace, world: int) -> tuple[dict, dict[str, torch.Tensor]]:
    callbacks = []
    if opts.save:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=os.path.join(opts.out, "ckpts"), every_n_epochs=1, save_top_k=-1
            )
        )
    precision: dict = {"precision": opts.precision}
    if opts.precision == "16-mixed":
        # Trainer(precision="16-mixed") on CPU becomes bf16-mixed; the plugin stays fp16.
        precision = {"plugins": [pl.plugins.precision.MixedPrecision("16-mixed", "cpu")]}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=_strategy(opts, "trainer"),
        **precision,
        max_epochs=opts.epochs,
        # Manual optimization (several optimizers) accumulates and clips itself.
        accumulate_grad_batches=ACCUMULATION if opts.optimizers == 1 else 1,
        gradient_clip_val=1.0 if opts.optimizers == 1 else None,
        gradient_clip_algorithm=opts.clip_algorithm,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=opts.save,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    model = LitModel(meta_build=opts.meta_build, nan_at=opts.nan_at)
    model.optimizers_returned = opts.optimizers
    model.optimizer_class = opts.optimizer_class
    if opts.optimizers > 1:  # Lightning itself refuses several in automatic optimization
        model.automatic_optimization = False
    if opts.validate:
        # The full weights of a checkpoint, outside fit.
        metrics = trainer.validate(model, loader(world), ckpt_path=opts.resume, verbose=False)
        return {"val_loss": metrics[0]["val_loss"], "optimizers": len(trainer.optimizers)}, {}
    trainer.fit(model, loader(world), ckpt_path=opts.resume)
    predicted = None
    if opts.predict:  # after fit: at stage 3 predict_step runs gathered as the model's forward
        predicted = float(sum(trainer.predict(model, loader(world))))  # type: ignore[arg-type]
    if opts.save_onto_file:
        blocker = os.path.join(opts.out, "a_file.ckpt")
        if trainer.is_global_zero:
            with open(blocker, "w") as f:
                f.write("not a checkpoint directory")
        trainer.strategy.barrier()
        trainer.save_checkpoint(blocker)
    if opts.fit_twice:
        trainer.fit_loop.max_epochs += 1
        trainer.fit(model, loader(world))
    strategy = trainer.strategy
    zero = getattr(strategy, "zero_optimizer", None)
    if zero is not None:
        params = zero.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    result = {
        "wrapped": model.wrapped,
        "syncs": model.syncs,
        "param_dtype": str(next(model.parameters()).dtype),
        "predicted": predicted,
        "losses": model.losses,
        "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr(),
        "global_step": trainer.global_step,
        "built_on": model.built_on,
        "optimizer": type(trainer.optimizers[0]).__name__,
    }
    if zero is not None:
        result["units"] = zero.units
        result["skipped_steps"] = int(zero._impl.skipped_steps())
        scale = getattr(trainer.precision_plugin, "loss_scale", None)
        result["loss_scale"] = scale.scale if scale is not None else None
        result["comm"] = zero.comm_stats()
        # This rank's parameter shards (without the gathered units' buffers).
        result["shard_bytes"] = zero._impl.parameter_bytes() - zero._impl.gathered_parameter_bytes()
    return result, params


def run_recipe(opts: argparse.Namespace, world: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """run_trainer's training written out in one process with a 16-bit model
    and fp32 master weights (zeroshard's mixed precision, "bf16-true" /
    "16-true" under ZeroShardStrategy), fp16 with a fixed loss scale of 2^8
    (the tests' config's initial_scale_power)."""
    assert world == 1
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}[opts.precision]
    scale = 2.0**8 if dtype == torch.float16 else 1.0
    model = LitModel().to(dtype)
    assert model.net is not None
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer, scheduler = make_optimizer(masters)
    losses: list[float] = []
    steps = 0
    for _ in range(opts.epochs):
        for i, batch in enumerate(loader(world)):
            loss = loss_of(model.net, batch) * model.temperature
            losses.append(loss.item())
            (loss * (scale / ACCUMULATION)).backward()
            if (i + 1) % ACCUMULATION == 0:
                for p, m in zip(params, masters, strict=True):
                    m.grad = p.grad.float() / scale
                    p.grad = None
                torch.nn.utils.clip_grad_norm_(masters, 1.0)
                optimizer.step()
                scheduler.step()  # type: ignore[attr-defined]
                optimizer.zero_grad()
                with torch.no_grad():
                    for p, m in zip(params, masters, strict=True):
                        p.copy_(m)
                steps += 1
    result = {
        "wrapped": "recipe",
        "losses": losses,
        "lr": scheduler.get_last_lr(),  # type: ignore[attr-defined]
        "global_step": steps,
        "optimizer": "AdamW",
    }
    return result, {n: m.detach() for n, m in zip(names, masters, strict=True)}


def run_fabric(opts: argparse.Namespace, world: int) -> tuple[dict, dict[str, torch.Tensor]]:
    strategy = _strategy(opts, "fabric")
    precision: dict = {"precision": opts.precision}
    if opts.precision == "16-mixed":
        # Fabric(precision="16-mixed") on CPU becomes bf16-mixed; the plugin stays fp16.
        from lightning.fabric.plugins.precision import MixedPrecision

        precision = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, **precision)
    fabric.launch()
    net = make_net()
    optimizer, scheduler = make_optimizer(net.parameters())
    model, optimizer, scheduler = fabric.setup(net, optimizer, scheduler=scheduler)
    data = fabric.setup_dataloaders(loader(world), use_distributed_sampler=False)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if opts.resume:
        fabric.load(opts.resume, state)
    losses: list[float] = []
    syncs: list[bool] = []
    step = state["step"]
    while step < opts.epochs * SAMPLES // GLOBAL_BATCH:
        for i, batch in enumerate(data):
            boundary = (i + 1) % ACCUMULATION == 0
            with fabric.no_backward_sync(model, enabled=not boundary):
                loss = loss_of(model, batch)
                fabric.backward(loss / ACCUMULATION)
                zero = getattr(fabric.strategy, "zero_optimizer", None)
                if zero is not None:
                    syncs.append(bool(zero._impl.gradient_sync()))
            losses.append(loss.item())
            if boundary:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                step += 1
        if opts.save:
            state["step"] = step
            fabric.save(os.path.join(opts.out, "ckpts", f"step={step}"), state)
    zero = getattr(fabric.strategy, "zero_optimizer", None)
    if zero is not None:
        params = zero.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in net.named_parameters()}
    result = {
        "wrapped": type(model._forward_module).__name__,
        "syncs": syncs,
        "losses": losses,
        "lr": scheduler.get_last_lr(),
        "global_step": step,
        "optimizer": type(optimizer.optimizer).__name__,
    }
    return result, params


DEFAULTS = {
    "api": "trainer",
    "strategy": "auto",
    "precision": "32-true",
    "epochs": 2,
    "save": False,
    "resume": None,
    "meta_build": False,
    "clip_algorithm": "norm",
    "expect_error": False,
    "validate": False,
    "nan_at": -1,
    "fit_twice": False,
    "save_onto_file": False,
    "config": None,
    "optimizers": 1,
    "predict": False,
    "optimizer_class": "AdamW",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("runs", help="a JSON list of runs: {name, api, strategy, ...}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for spec in json.loads(args.runs):
        opts = argparse.Namespace(**{**DEFAULTS, **spec})
        opts.out = os.path.join(args.out, spec["name"])
        os.makedirs(opts.out, exist_ok=True)
        run = {"trainer": run_trainer, "fabric": run_fabric, "recipe": run_recipe}[opts.api]
        try:
            result, params = run(opts, world)
        except Exception as error:  # noqa: BLE001 - an expected error is the result
            if not opts.expect_error:
                raise
            result, params = {"error": f"{type(error).__name__}: {error}"}, {}
            if dist.is_initialized():  # what every rank raised
                errors: list = [None] * dist.get_world_size()
                dist.all_gather_object(errors, result["error"])
                result["errors"] = errors
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(params, os.path.join(opts.out, "params.pt"))
            with open(os.path.join(opts.out, "result.json"), "w") as f:
                json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
