"""ZeroShardStrategy (zeroshard.integrations.lightning) in the real Lightning
Trainer and Fabric.

Two jobs of tests/python/scripts/lightning_job.py under torchrun (CPU ranks
over Gloo) hold every run, one after the other in the same processes
(importing lightning costs more than a run): on 2 ranks, DDP and every
registered zeroshard strategy, checkpoints and the resumes; on 1 rank, the
single-process references (Lightning's default strategy) and the resumes at
world size 1. Each run trains a tiny model with AdamW (weight decay), a
per-step LR schedule, gradient clipping at 1.0, accumulate_grad_batches=2 and
a global batch of 8 whatever the world size, for 4 optimizer steps.

The yardstick for "same result as one process" is Lightning's DDP strategy on
the same 2 ranks. Neither is bit-identical to one process: each rank's loss
is the mean over half the batch (another rounding of the mean) and the clip
coefficient comes from a norm summed in another order (torch's norm of
per-tensor norms; zeroshard's sum of squares over shards). The tests assert
the brief's fp32 bound, 1e-6 from one process, or 2x DDP's distance where
that is larger (as test_hf_trainer.py does), and print both. Measured when
this was written: Trainer DDP 6.7e-8, stages 1-3 1.2e-7, with CPU offload
4.8e-7 (the host Adam kernel rounds differently); Fabric DDP and stage 2
3.0e-8; resumed at world size 1, 1.5e-8 from the 2-rank run. Stage 3 runs
with stage3_param_persistence_threshold 0, so that the tiny model's
parameters are gathered and released (they would all stay whole), and the
LightningModule owns a parameter of its own, read in training_step only.
bf16-mixed and 16-mixed (autocast) are held to DDP at the same precision
(measured: both 5.0e-3 and 7.0e-5 from one process); bf16-true and 16-true (a
16-bit model, fp32 masters) to that recipe written out in one process, within
test_engine.py's bounds for it, 5e-3 and 3e-4 (measured 4.98e-3, 7.1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from rank_processes import free_port  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "lightning_job.py")
STAGES = [
    "zeroshard_stage_1",
    "zeroshard_stage_2",
    "zeroshard_stage_2_offload",
    "zeroshard_stage_3",
    "zeroshard_stage_3_offload",
]
TRAINER_CHECKPOINT = "trainer-zeroshard_stage_2/ckpts/epoch=0-step=2.ckpt"
TRAINER_FINAL_CHECKPOINT = "trainer-zeroshard_stage_2/ckpts/epoch=1-step=4.ckpt"
PRECISIONS = {"bf16": "bf16-mixed", "fp16": "16-mixed"}
PRECISION_RUNS = [
    {"name": f"trainer-{kind}-{short}", "strategy": strategy, "precision": precision}
    for short, precision in PRECISIONS.items()
    for kind, strategy in (("ddp", "ddp"), ("zeroshard", "zeroshard_stage_2"))
]
# The model in 16 bits with fp32 master weights, against that recipe written
# out in one process, within test_engine.py's bounds for the same recipe: the
# ranks sum 16-bit gradients of half the batch where the recipe rounds one of
# the whole batch.
TRUE_PRECISIONS = {"bf16-true": 5e-3, "16-true": 3e-4}
TRUE_RUNS = [
    {
        "name": f"trainer-stage{stage}-{precision}",
        "precision": precision,
        # A scale the tiny model's fp16 gradients never overflow at (the
        # recipe's), so that both take the same steps.
        "config": {
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "fp16": {"initial_scale_power": 8},
        },
    }
    for precision in TRUE_PRECISIONS
    for stage in (2, 3)
]
FABRIC_CHECKPOINT = "fabric-zeroshard_stage_2/ckpts/step=2"


def _run_job(out: Path, runs: list[dict], world: int) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
         f"--master_port={free_port()}", JOB, str(out), json.dumps(runs)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _results(out: Path, runs: list[dict]) -> dict[str, dict]:
    results = {}
    for run in runs:
        result = json.loads((out / run["name"] / "result.json").read_text())
        result["params"] = torch.load(out / run["name"] / "params.pt")
        results[run["name"]] = result
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], Path]:
    out = tmp_path_factory.mktemp("two_ranks")
    runs: list[dict] = [{"name": "trainer-ddp", "strategy": "ddp"}]
    runs += [
        {"name": f"trainer-{s}", "strategy": s, "save": s == "zeroshard_stage_2", "predict": True}
        for s in STAGES
    ]
    runs += [
        {"name": "trainer-stage3-meta", "strategy": "zeroshard_stage_3", "meta_build": True},
        {"name": "trainer-resumed", "strategy": "zeroshard_stage_2",
         "resume": str(out / TRAINER_CHECKPOINT)},
        {"name": "trainer-validate", "strategy": "zeroshard_stage_3", "validate": True,
         "resume": str(out / TRAINER_FINAL_CHECKPOINT)},
        {"name": "trainer-clip-by-value", "strategy": "zeroshard_stage_2",
         "clip_algorithm": "value", "expect_error": True},
        *PRECISION_RUNS,
        *TRUE_RUNS,
        {"name": "trainer-two-optimizers", "strategy": "zeroshard_stage_2", "optimizers": 2,
         "expect_error": True},
        {"name": "trainer-fit-twice", "strategy": "zeroshard_stage_1", "epochs": 1,
         "fit_twice": True, "expect_error": True},
        {"name": "trainer-save-onto-file", "strategy": "zeroshard_stage_2", "epochs": 1,
         "save_onto_file": True, "expect_error": True},
        {"name": "trainer-fp16-nan", "strategy": "zeroshard_stage_2", "precision": "16-mixed",
         "nan_at": 1},
        {"name": "trainer-ddp-radam", "strategy": "ddp", "optimizer_class": "RAdam"},
        {"name": "trainer-zeroshard-radam", "strategy": "zeroshard_stage_2",
         "optimizer_class": "RAdam"},
        {"name": "fabric-ddp", "api": "fabric", "strategy": "ddp"},
        {"name": "fabric-ddp-fp16", "api": "fabric", "strategy": "ddp", "precision": "16-mixed"},
        {"name": "fabric-zeroshard-fp16", "api": "fabric", "strategy": "zeroshard_stage_2",
         "precision": "16-mixed"},
        {"name": "fabric-zeroshard_stage_2", "api": "fabric", "strategy": "zeroshard_stage_2",
         "save": True},
        {"name": "fabric-resumed", "api": "fabric", "strategy": "zeroshard_stage_2",
         "resume": str(out / FABRIC_CHECKPOINT)},
    ]  # fmt: skip
    proc = _run_job(out, runs, world=2)
    assert proc.returncode == 0, f"exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return _results(out, runs), out


@pytest.fixture(scope="module")
def one_rank(
    tmp_path_factory: pytest.TempPathFactory, two_ranks: tuple[dict[str, dict], Path]
) -> dict[str, dict]:
    _, saved = two_ranks
    out = tmp_path_factory.mktemp("one_rank")
    runs = [
        {"name": "trainer-single", "strategy": "auto"},
        *(
            {"name": f"trainer-single-{short}", "strategy": "auto", "precision": precision}
            for short, precision in PRECISIONS.items()
        ),
        {"name": "trainer-single-radam", "strategy": "auto", "optimizer_class": "RAdam"},
        {"name": "fabric-single", "api": "fabric", "strategy": "auto"},
        {"name": "fabric-single-fp16", "api": "fabric", "strategy": "auto",
         "precision": "16-mixed"},
        *({"name": f"recipe-{p}", "api": "recipe", "precision": p} for p in TRUE_PRECISIONS),
        # The 2-rank stage 2 checkpoints, resharded onto 1 rank at stage 3.
        {"name": "trainer-resumed-world1", "strategy": "zeroshard_stage_3",
         "resume": str(saved / TRAINER_CHECKPOINT)},
        {"name": "fabric-resumed-world1", "api": "fabric", "strategy": "zeroshard_stage_3",
         "resume": str(saved / FABRIC_CHECKPOINT)},
    ]  # fmt: skip
    proc = _run_job(out, runs, world=1)
    assert proc.returncode == 0, f"exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return _results(out, runs)


@pytest.fixture(scope="module")
def initial() -> dict[str, torch.Tensor]:
    sys.path.insert(0, os.path.dirname(JOB))
    from lightning_job import make_net

    initial = {k: v.detach().clone() for k, v in make_net().named_parameters()}
    return {**initial, "temperature": torch.tensor(1.25)}  # the LightningModule's own


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    a = {k.removeprefix("net."): v for k, v in a.items()}
    b = {k.removeprefix("net."): v for k, v in b.items()}
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _moved(params: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> float:
    """How far ``params`` got from their initial values."""
    return _diff(params, {k: v for k, v in initial.items() if k in _stripped(params)})


def _stripped(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("net."): v for k, v in params.items()}


def _check_against_reference(
    name: str, result: dict, reference: dict, ddp: dict, initial: dict, model: str
) -> None:
    ddp_diff = _diff(ddp["params"], reference["params"])
    zero_diff = _diff(result["params"], reference["params"])
    print(f"{name}: zeroshard {zero_diff:.3e} from single-process; DDP {ddp_diff:.3e}")
    assert ddp["wrapped"] == "DistributedDataParallel"  # the yardstick is what it claims
    assert result["wrapped"] == model, result["wrapped"]  # no DDP around it
    assert result["optimizer"] == "ZeroOptimizer"
    assert result["global_step"] == reference["global_step"] == 4
    assert _moved(result["params"], initial) > 1e-3  # it trained
    assert zero_diff <= max(1e-6, 2 * ddp_diff), (zero_diff, ddp_diff)
    assert result["lr"] == pytest.approx(reference["lr"])


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_matches_single_process(
    stage: str, two_ranks: tuple[dict, Path], one_rank: dict, initial: dict
) -> None:
    results, _ = two_ranks
    result = results[f"trainer-{stage}"]
    reference, ddp = one_rank["trainer-single"], results["trainer-ddp"]
    _check_against_reference(stage, result, reference, ddp, initial, "LitModel")
    # Accumulation: the first micro-step of each step runs under no_sync.
    assert result["syncs"] == [False, True] * 4, result["syncs"]
    if "stage_3" in stage:
        # The LightningModule owns a parameter: its unit (with the modules outside
        # the repeated blocks) is gathered around training_step.
        assert result["units"] == ["<root>", "net.blocks.0", "net.blocks.1"], result["units"]


def test_trainer_with_another_torch_optim_class_matches_single_process(
    two_ranks: tuple[dict, Path], one_rank: dict, initial: dict
) -> None:
    """configure_optimizers returning torch.optim.RAdam: the ZeroOptimizer runs
    RAdam itself on its shards, with its hyper-parameters and scheduler."""
    results, _ = two_ranks
    result = results["trainer-zeroshard-radam"]
    reference, ddp = one_rank["trainer-single-radam"], results["trainer-ddp-radam"]
    _check_against_reference("RAdam stage 2", result, reference, ddp, initial, "LitModel")
    # Not AdamW's values: the class is what ran.
    assert _diff(result["params"], one_rank["trainer-single"]["params"]) > 1e-4


def test_trainer_checkpoint_resumes_exactly_and_at_world_size_1(
    two_ranks: tuple[dict, Path], one_rank: dict
) -> None:
    results, out = two_ranks
    straight = results["trainer-zeroshard_stage_2"]
    checkpoint = out / TRAINER_CHECKPOINT
    assert (checkpoint / "zeroshard" / "index.json").is_file()  # ModelCheckpoint wrote it
    assert (checkpoint / "lightning.pt").is_file()
    # Same world size and stage: the state is restored exactly (weights,
    # optimizer, schedule, loops).
    resumed = results["trainer-resumed"]
    assert _diff(resumed["params"], straight["params"]) == 0.0
    assert resumed["global_step"] == 4
    assert resumed["losses"] == straight["losses"][len(straight["losses"]) // 2 :]
    assert resumed["lr"] == straight["lr"]
    # One rank at stage 3: the checkpoint reshards; only reduction order differs.
    other = one_rank["trainer-resumed-world1"]
    diff = _diff(other["params"], straight["params"])
    yardstick = _diff(results["trainer-ddp"]["params"], straight["params"])
    print(f"resumed on 1 rank at stage 3: {diff:.3e} from 2 ranks at stage 2 (DDP {yardstick:.3e})")
    assert other["global_step"] == 4 and other["lr"] == pytest.approx(straight["lr"])
    assert diff <= 2 * yardstick + 1e-6, (diff, yardstick)


def test_convert_to_lightning_checkpoint_loads_anywhere(
    two_ranks: tuple[dict, Path], tmp_path: Path
) -> None:
    from zeroshard.integrations.lightning import convert_to_lightning_checkpoint

    sys.path.insert(0, os.path.dirname(JOB))
    from lightning_job import LitModel

    results, out = two_ranks
    plain = tmp_path / "model.ckpt"
    convert_to_lightning_checkpoint(
        out / "trainer-zeroshard_stage_2" / "ckpts" / "epoch=1-step=4.ckpt", plain
    )
    model = LitModel.load_from_checkpoint(plain)
    assert (
        _diff(dict(model.named_parameters()), results["trainer-zeroshard_stage_2"]["params"]) == 0
    )
    assert float(model.net.scale) == 0.5  # the buffer, from lightning.pt
    assert "optimizer_states" not in torch.load(plain, weights_only=False)


def test_stage3_configure_model_builds_partitioned(
    two_ranks: tuple[dict, Path], one_rank: dict, initial: dict
) -> None:
    # configure_model runs on the meta device; each rank materializes only its
    # shards, initialized as the eagerly built model (same seed, same order).
    results, _ = two_ranks
    result = results["trainer-stage3-meta"]
    assert result["built_on"] == "meta"
    total_bytes = 4 * sum(v.numel() for v in initial.values())
    assert 0 < result["shard_bytes"] < 0.75 * total_bytes, (result["shard_bytes"], total_bytes)
    reference, ddp = one_rank["trainer-single"], results["trainer-ddp"]
    _check_against_reference("stage 3, meta", result, reference, ddp, initial, "LitModel")


def test_fabric_stage2_matches_saves_and_resumes(
    two_ranks: tuple[dict, Path], one_rank: dict, initial: dict
) -> None:
    results, out = two_ranks
    straight, ddp = results["fabric-zeroshard_stage_2"], results["fabric-ddp"]
    _check_against_reference(
        "Fabric stage 2", straight, one_rank["fabric-single"], ddp, initial, "Net"
    )
    assert (out / FABRIC_CHECKPOINT / "zeroshard" / "index.json").is_file()
    resumed = results["fabric-resumed"]
    assert _diff(resumed["params"], straight["params"]) == 0.0
    assert resumed["lr"] == straight["lr"] and resumed["global_step"] == 4
    assert straight["syncs"] == [False, True] * 4  # no_backward_sync reached zeroshard
    other = one_rank["fabric-resumed-world1"]
    diff = _diff(other["params"], straight["params"])
    yardstick = _diff(ddp["params"], straight["params"])
    print(f"Fabric resumed on 1 rank at stage 3: {diff:.3e} (DDP {yardstick:.3e})")
    assert diff <= 2 * yardstick + 1e-6, (diff, yardstick)


def test_clipping_by_value_is_refused_on_every_rank(two_ranks: tuple[dict, Path]) -> None:
    results, _ = two_ranks
    errors = results["trainer-clip-by-value"]["errors"]
    assert len(errors) == 2
    assert all("gradient_clip_algorithm='value' is not supported" in e for e in errors), errors


def test_two_optimizers_are_refused_on_every_rank(two_ranks: tuple[dict, Path]) -> None:
    results, _ = two_ranks
    errors = results["trainer-two-optimizers"]["errors"]
    assert len(errors) == 2
    assert all("needs exactly one optimizer from configure_optimizers" in e for e in errors)
    assert all("['AdamW', 'SGD']" in e for e in errors), errors


def test_predict_after_fit_runs_gathered_at_stage_3(two_ranks: tuple[dict, Path]) -> None:
    # At stage 3 predict_step runs as the LightningModule's forward: its own
    # parameter (and the units outside the blocks) are gathered for it.
    results, _ = two_ranks
    expected = results["trainer-zeroshard_stage_1"]["predicted"]
    for stage in STAGES[1:]:
        assert results[f"trainer-{stage}"]["predicted"] == pytest.approx(expected, rel=1e-5)


def test_a_second_fit_is_refused_on_every_rank(two_ranks: tuple[dict, Path]) -> None:
    results, _ = two_ranks
    errors = results["trainer-fit-twice"]["errors"]
    assert len(errors) == 2
    assert all("a second fit with the same strategy is not supported" in e for e in errors), errors


def test_a_failed_save_on_rank_0_raises_on_every_rank(two_ranks: tuple[dict, Path]) -> None:
    results, _ = two_ranks
    errors = results["trainer-save-onto-file"]["errors"]
    assert len(errors) == 2
    assert all("failed on rank 0: FileExistsError" in e and "is a file" in e for e in errors)


def test_unsupported_settings_raise_clear_errors(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from zeroshard.integrations.lightning import ZeroShardStrategy
    from zeroshard.integrations.lightning._shared import (
        ZeroArguments,
        check_checkpoint_directory,
        check_lightning_version,
        zero_optimizer_from,
    )

    with pytest.raises(ImportError, match=r"supports lightning>=2.6,<2.7; lightning 2.5.0"):
        check_lightning_version("2.5.0")
    with pytest.raises(ValueError, match="must be 1, 2 or 3"):
        ZeroShardStrategy(stage=4)
    with pytest.raises(ValueError, match=r"'16-true'\], got '64-true'"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroShardStrategy(), precision="64-true")
    net = torch.nn.Linear(2, 2)
    arguments = ZeroArguments({"zero_optimization": {"stage": 2}}, 1, "32-true", 1, None)
    # Another torch.optim class (RMSprop, RAdam) is taken as itself:
    # test_trainer_with_another_torch_optim_class_matches_single_process.
    with pytest.raises(ValueError, match="maximize=True"):
        zero_optimizer_from(torch.optim.Adam(net.parameters(), maximize=True), net, arguments)
    with pytest.raises(ValueError, match="'optimizer' section"):
        ZeroArguments({"optimizer": {"type": "AdamW"}}, 1, "32-true", 1, None)
    with pytest.raises(ValueError, match="gradient_accumulation_steps = 4 but accumulate_grad"):
        ZeroArguments({"gradient_accumulation_steps": 4}, 1, "32-true", 2, None)
    with pytest.raises(ValueError, match="bf16.enabled = True but the precision is '32-true'"):
        ZeroArguments({"bf16": {"enabled": True}}, 1, "32-true", 1, None)
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, plain)
    with pytest.raises(ValueError, match="not a ZeroShardStrategy checkpoint.*cannot be resharded"):
        check_checkpoint_directory(plain)


@pytest.mark.parametrize("short", sorted(PRECISIONS))
def test_trainer_mixed_precision_matches_single_process(
    short: str, two_ranks: tuple[dict, Path], one_rank: dict, initial: dict
) -> None:
    # bf16-mixed: autocast over the fp32 weights. 16-mixed (the plugin: the
    # Trainer's precision flag turns into bf16 on CPU): autocast to fp16 and
    # zeroshard's loss scaling where the references use torch's GradScaler.
    results, _ = two_ranks
    result = results[f"trainer-zeroshard-{short}"]
    reference = one_rank[f"trainer-single-{short}"]
    ddp = results[f"trainer-ddp-{short}"]
    _check_against_reference(short, result, reference, ddp, initial, "LitModel")
    fp32 = one_rank["trainer-single"]
    # It computed in 16 bits: 7.6e-5 (fp16) and 5e-3 (bf16) from fp32 when this was
    # written, where 32-bit runs differ by 3e-8.
    assert _diff(result["params"], fp32["params"]) > 1e-5


@pytest.mark.parametrize("run", [r["name"] for r in TRUE_RUNS])
def test_trainer_16_bit_model_with_fp32_masters_matches_the_recipe(
    run: str, two_ranks: tuple[dict, Path], one_rank: dict, initial: dict
) -> None:
    results, _ = two_ranks
    result = results[run]
    precision = run.split("-", 2)[2]
    recipe = one_rank[f"recipe-{precision}"]
    diff = _diff(result["params"], recipe["params"])
    print(f"{run}: fp32 masters {diff:.3e} from the one-process recipe")
    assert (
        result["param_dtype"]
        == {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}[precision]
    )
    assert all(v.dtype == torch.float32 for v in result["params"].values())  # the masters
    assert result["wrapped"] == "LitModel" and result["optimizer"] == "ZeroOptimizer"
    assert result["global_step"] == recipe["global_step"] == 4
    assert _moved(result["params"], initial) > 1e-3
    assert diff <= TRUE_PRECISIONS[precision], diff
    assert result["lr"] == pytest.approx(recipe["lr"])
    if precision == "16-true":  # the config's scale, and no overflow
        assert result["loss_scale"] == 2.0**8 and result["skipped_steps"] == 0


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(
    two_ranks: tuple[dict, Path], one_rank: dict, initial: dict
) -> None:
    results, _ = two_ranks
    result = results["trainer-fp16-nan"]
    assert result["skipped_steps"] == 1  # the NaN step changed nothing, on every rank
    assert result["loss_scale"] == 2.0**15  # halved from 2**16
    assert all(torch.isfinite(v).all() for v in result["params"].values())
    assert _moved(result["params"], initial) > 1e-3
    assert results["trainer-zeroshard-fp16"]["loss_scale"] == 2.0**16  # no overflow there
    # Fabric at 16-mixed: zeroshard's loss scaling where the others use GradScaler.
    _check_against_reference(
        "Fabric fp16",
        results["fabric-zeroshard-fp16"],
        one_rank["fabric-single-fp16"],
        results["fabric-ddp-fp16"],
        initial,
        "Net",
    )


def test_validate_loads_the_full_weights(two_ranks: tuple[dict, Path]) -> None:
    sys.path.insert(0, os.path.dirname(JOB))
    from lightning_job import dataset, loss_of, make_net

    results, _ = two_ranks
    net = make_net()
    final = results["trainer-zeroshard_stage_2"]["params"]
    net.load_state_dict({k.removeprefix("net."): v for k, v in final.items()}, strict=False)
    with torch.no_grad():
        expected = (loss_of(net, list(dataset().tensors)) * final["temperature"]).item()
    validated = results["trainer-validate"]
    assert validated["optimizers"] == 0
    assert validated["val_loss"] == pytest.approx(expected, rel=1e-6)


def test_dynamic_loss_scale() -> None:
    from zeroshard.integrations.lightning._shared import DynamicLossScale

    scale = DynamicLossScale(initial_scale_power=4, window=2, min_scale=2.0)
    assert scale.scale == 16.0
    scale.update(skipped=False)
    scale.update(skipped=False)
    assert scale.scale == 32.0  # a window of good steps doubles it
    for _ in range(6):
        scale.update(skipped=True)
    assert scale.scale == 2.0  # each overflow halves it, down to the minimum
    restored = DynamicLossScale()
    restored.load_state_dict(scale.state_dict())
    assert restored.scale == 2.0 and restored.good_steps == 0


def test_the_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    here = os.path.dirname(JOB)
    example = os.path.join(here, "..", "..", "..", "examples", "lightning_gpt.py")
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(here, "..", "..", "..", "python")
    )
    out = tmp_path / "out"
    # Stage 3 (built partitioned by configure_model), then resumed at stage 2 with offload.
    runs = [
        (2, ["--stage", "3"]),
        (4, ["--stage", "2", "--offload", "--resume", str(out / "last.ckpt")]),
    ]
    for steps, extra in runs:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             f"--master_port={free_port()}", example, "--out", str(out), "--steps", str(steps),
             *extra],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, f"{extra}:\n{proc.stdout}\n{proc.stderr}"
        assert f"[lightning_gpt] {steps} steps" in proc.stdout, proc.stdout
    assert (out / "last.ckpt" / "zeroshard" / "index.json").is_file()
    assert "state_dict" in torch.load(out / "model.ckpt", weights_only=False)


def test_registered_names_and_config(tmp_path: Path) -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from zeroshard.integrations.lightning import ZeroShardStrategy
    from zeroshard.integrations.lightning.fabric import ZeroShardStrategy as FabricStrategy

    for registry, cls in (
        (StrategyRegistry, ZeroShardStrategy),
        (STRATEGY_REGISTRY, FabricStrategy),
    ):
        offload = registry.get("zeroshard_stage_3_offload")
        assert type(offload) is cls
        zero = offload.config["zero_optimization"]
        assert zero["stage"] == 3
        assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
        for stage in (1, 2, 3):
            assert registry.get(f"zeroshard_stage_{stage}").config == {
                "zero_optimization": {"stage": stage}
            }
    # A config (a path or a dict) wins over the keyword arguments, as in DeepSpeedStrategy.
    path = tmp_path / "ds.json"
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    path.write_text(json.dumps(config))
    assert ZeroShardStrategy(config=str(path), stage=1).config == config
    assert ZeroShardStrategy(config=config, stage=1).stage == 3
    with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
        ZeroShardStrategy(config=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="offload_parameters=True\\) needs stage=3"):
        ZeroShardStrategy(stage=2, offload_parameters=True)
