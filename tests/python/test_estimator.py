"""The memory estimator: published figures, DeepSpeed's formulas, the CLI, the plot,
and agreement with what ZeroOptimizer actually allocates."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.__main__ import main as cli_main
from zeroshard.estimator import count_model, deepspeed_estimate, parse_bytes, parse_count

from dist_harness import run_ranks, unwrap


def test_zero_paper_figures() -> None:
    rows = zeroshard.estimate(num_params="7.5B", world_size=64)
    got = [r["model_state_bytes"] / 1e9 for r in rows]
    assert got == pytest.approx([120.0, 31.4, 16.6, 1.875], abs=0.05)


def test_tensor_and_pipeline_degrees_split_the_model_before_zero() -> None:
    # 175B on 64 ranks as TP 8 x PP 4 x DP 2: ZeRO over 2 ranks of a 1/32 slice.
    rows = zeroshard.estimate(
        num_params="175B", world_size=64, tensor_parallel_size=8, pipeline_parallel_size=4
    )
    sliced = zeroshard.estimate(num_params=175e9 / 32, world_size=2)
    assert [r["model_state_bytes"] for r in rows] == [r["model_state_bytes"] for r in sliced]
    assert rows[3]["model_state_bytes"] == pytest.approx(8 * 175e9 / 32)
    with pytest.raises(ValueError, match="must be a multiple of tensor_parallel_size"):
        zeroshard.estimate(num_params="1B", world_size=12, tensor_parallel_size=8)


def test_deepspeed_formulas_through_python() -> None:
    p, n = 1e9, 16
    assert deepspeed_estimate(2, p, world_size=n, ranks_per_node=8)["device_bytes"] == (
        2 * p + 18 * p / n
    )
    assert (
        deepspeed_estimate(3, p, world_size=n, largest_unit_params=5e7, offload_optimizer="cpu")[
            "device_bytes"
        ]
        == 4 * 5e7 + 2 * p / n
    )


def test_counts_tied_parameters_once_and_finds_the_largest_unit() -> None:
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 100, bias=False))
    model[1].weight = model[0].weight
    assert count_model(model) == (800, 800)


def test_parsing_and_bad_input() -> None:
    assert parse_count("350M") == 350e6
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("24GiB") == 24 * 2**30
    with pytest.raises(ValueError, match="cannot read a memory size"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="parameter offload needs ZeRO stage 3"):
        zeroshard._C.estimate_memory(2, 1e9, 0, 8, 1, "mixed16", "adam", "none", "cpu")
    with pytest.raises(ValueError, match="unknown precision recipe 'fp8'"):
        zeroshard.estimate(1e9, world_size=2, precision="fp8")


def test_cli_prints_table_and_recommendation(capsys) -> None:
    assert (
        cli_main(
            [
                "estimate",
                "--params",
                "13B",
                "--world-size",
                "8",
                "--ranks-per-node",
                "8",
                "--device-memory",
                "60GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "recommendation: ZeRO stage 2 is the first configuration that fits" in out
    assert "ZeRO stage 1 would need 71.5 GB" in out


def test_recommendation_counts_tensor_and_pipeline_degrees(capsys) -> None:
    # 175B on 64 ranks of 80 GB: as pure ZeRO over 64 ranks only stage 3
    # fits (stage 2 keeps every 16-bit parameter: 350 GB); TP 8 x PP 4 puts a
    # 1/32 slice on each rank, and stage 1 over the remaining 2 ranks fits it.
    flat = zeroshard.recommend("175B", device_memory="80GB", world_size=64, ranks_per_node=8)
    split = zeroshard.recommend(
        "175B",
        device_memory="80GB",
        world_size=64,
        ranks_per_node=8,
        tensor_parallel_size=8,
        pipeline_parallel_size=4,
    )
    assert flat["fits"] and flat["estimate"]["stage"] == 3
    assert split["fits"] and split["estimate"]["stage"] == 1
    sliced = zeroshard.estimate(
        "175B", world_size=64, ranks_per_node=8, tensor_parallel_size=8, pipeline_parallel_size=4
    )
    chosen = next(r for r in sliced if r["stage"] == split["estimate"]["stage"])
    assert split["estimate"]["device_bytes"] == chosen["device_bytes"]
    assert split["estimate"]["device_bytes"] != flat["estimate"]["device_bytes"]
    args = ["estimate", "--params", "175B", "--world-size", "64", "--ranks-per-node", "8"]
    args += ["--device-memory", "80GB", "--tensor-parallel", "8", "--pipeline-parallel", "4"]
    assert cli_main(args) == 0
    assert split["reason"] in capsys.readouterr().out


def test_cli_prints_traffic_per_group(capsys) -> None:
    # GPT-3's shape as TP 8 x PP 4 x DP 2: activations dominate, not ZeRO.
    args = ["estimate", "--params", "175B", "--world-size", "64", "--tensor-parallel", "8"]
    args += ["--pipeline-parallel", "4", "--layers", "96", "--hidden", "12288"]
    args += ["--sequence-length", "2048", "--micro-batch", "1", "--micro-batches", "8"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    rows = zeroshard.estimate_traffic(
        "175B",
        world_size=64,
        tensor_parallel_size=8,
        pipeline_parallel_size=4,
        layers=96,
        hidden=12288,
        sequence_length=2048,
        micro_batch=1,
        micro_batches=8,
    )
    stage1 = rows[1]
    assert stage1["tensor_parallel_bytes"] > stage1["data_parallel_bytes"] > 0
    assert stage1["pipeline_parallel_bytes"] > 0
    text = (
        f"stage 1 DP {stage1['data_parallel_bytes'] / 1e9:.3g} + "
        f"TP {stage1['tensor_parallel_bytes'] / 1e9:.3g} + "
        f"PP {stage1['pipeline_parallel_bytes'] / 1e9:.3g}"
    )
    assert text in out, out


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is an optional extra; scripts/ensure_env.sh installs it",
)
def test_plot_writes_a_png(tmp_path) -> None:
    path = tmp_path / "memory.png"
    zeroshard.estimator.plot(str(path), "7.5B", device_memory="80GB")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Mlp(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 128)
        ).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _measure(rank: int, world_size: int) -> list[dict[str, Any]]:
    out = []
    for stage, dtype, amsgrad in (
        (1, torch.float32, False),
        (2, torch.float32, False),
        (2, torch.bfloat16, False),
        (3, torch.float32, False),
        (3, torch.bfloat16, False),
        # amsgrad's max_exp_avg_sq: a third state the estimate once left out.
        (2, torch.bfloat16, True),
        (3, torch.float32, True),
    ):
        torch.manual_seed(0)
        model = _Mlp(dtype)
        stage3 = {"module": model, "stage3_param_persistence_threshold": 0} if stage == 3 else {}
        optimizer = zeroshard.ZeroOptimizer(
            model.parameters(), "adamw", stage=stage, amsgrad=amsgrad, **stage3
        )
        x = torch.randn(8, 128, dtype=dtype)
        for _ in range(2):
            optimizer.zero_grad()
            model(x).float().pow(2).mean().backward()
            measured_grads = optimizer.gradient_bytes()
            optimizer.step()
        # Parameter storage between steps: the whole flat buffer at stages 1-2,
        # the shard (nothing stays gathered) at stage 3.
        out.append(
            {
                "stage": stage,
                "precision": "fp32" if dtype == torch.float32 else "mixed16",
                "optimizer": "adam_amsgrad" if amsgrad else "adamw",
                "num_params": sum(p.numel() for p in model.parameters()),
                "measured": optimizer.parameter_bytes()
                + measured_grads
                + optimizer.optimizer_state_bytes(),
            }
        )
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_estimate_matches_what_zeroshard_allocates(world_size: int) -> None:
    for rank_rows in unwrap(run_ranks(world_size, _measure)):
        for row in rank_rows:
            estimated = zeroshard.estimate(
                row["num_params"],
                world_size=world_size,
                precision=row["precision"],
                optimizer=row["optimizer"],
                stages=(row["stage"],),
            )[0]["model_state_bytes"]
            error = abs(row["measured"] - estimated) / estimated
            print(
                f"world_size={world_size} stage {row['stage']} {row['precision']} "
                f"{row['optimizer']}: measured "
                f"{row['measured']} B, estimated {estimated:.0f} B, {100 * error:.2f}% apart"
            )
            assert error <= 0.03


def _measure_traffic(rank: int, world_size: int) -> list[dict[str, Any]]:
    out = []
    for stage in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = _Mlp(dtype)
            # Stage 3 without the prefetch window, which would keep the units
            # the backward reuses gathered (and move less than the theory).
            stage3 = (
                {
                    "module": model,
                    "stage3_param_persistence_threshold": 0,
                    "stage3_prefetch_bucket_size": 0,
                }
                if stage == 3
                else {}
            )
            optimizer = zeroshard.ZeroOptimizer(model.parameters(), "adamw", stage=stage, **stage3)
            x = torch.randn(8, 128, dtype=dtype)
            for _ in range(2):
                optimizer.reset_comm_stats()  # the second step is the one measured
                optimizer.zero_grad()
                model(x).float().pow(2).mean().backward()
                optimizer.step()
            out.append(
                {
                    "stage": stage,
                    "precision": "fp32" if dtype == torch.float32 else "mixed16",
                    "num_params": sum(p.numel() for p in model.parameters()),
                    **optimizer.comm_stats(),
                }
            )
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_traffic_estimate_matches_what_zeroshard_sends(world_size: int) -> None:
    # comm_stats() counts each collective's full size; the estimate says the
    # same in those terms. What it leaves out: padding to the shard size and
    # the step's agreements (a few bytes each).
    for row in unwrap(run_ranks(world_size, _measure_traffic))[0]:
        expected = zeroshard.estimate_traffic(
            row["num_params"],
            world_size=world_size,
            precision=row["precision"],
            stages=(row["stage"],),
        )[0]
        for kind in ("reduce_scatter", "all_gather"):
            measured, estimated = row[f"{kind}_bytes"], expected[f"{kind}_bytes"]
            error = abs(measured - estimated) / estimated
            print(
                f"world {world_size} stage {row['stage']} {row['precision']} {kind}: measured "
                f"{measured} B, estimated {estimated:.0f} B, {100 * error:.2f}% apart"
            )
            assert error <= 0.01, (row, expected)


UNIT_WIDTH, UNITS = 64, 6
UNIT_NUMEL = UNIT_WIDTH * UNIT_WIDTH + UNIT_WIDTH  # a Linear: its own unit, its own bucket


def _measure_buffers(
    rank: int, world_size: int, extra: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    out = []
    for stage in (2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(UNIT_WIDTH, UNIT_WIDTH) for _ in range(UNITS)))
        model = model.to(torch.bfloat16)
        stage3 = (
            {
                "module": model,
                "unit_classes": (nn.Linear,),
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 2 * UNIT_NUMEL,
            }
            if stage == 3
            else {}
        )
        stage3.update(extra or {})
        optimizer = zeroshard.ZeroOptimizer(
            model.parameters(), "adamw", stage=stage, reduce_bucket_size=UNIT_NUMEL, **stage3
        )
        x = torch.randn(4, UNIT_WIDTH, dtype=torch.bfloat16)
        peaks = {"staging": 0, "gathered": 0}
        for _ in range(3):
            optimizer.zero_grad()
            optimizer.reset_peak_staging_bytes()
            if stage == 3:
                optimizer.reset_peak_gathered_parameter_bytes()
            model(x).float().pow(2).mean().backward()
            optimizer.step()
            peaks["staging"] = max(peaks["staging"], optimizer.peak_staging_bytes())
            if stage == 3:
                peaks["gathered"] = max(
                    peaks["gathered"], optimizer.peak_gathered_parameter_bytes()
                )
        out.append({"stage": stage, **peaks})
    return out


@pytest.mark.parametrize("fp32_reduction_and_live_cap", [False, True], ids=["default", "capped"])
def test_estimate_counts_the_gradient_buckets_and_gathered_units_zeroshard_holds(
    fp32_reduction_and_live_cap: bool,
) -> None:
    # The buffers beyond the model states: the gradient buckets being filled
    # and reduced (the staging ZeroOptimizer counts) and, at stage 3, the
    # units gathered at once. Six equal buckets, so the estimate's
    # max_buckets_in_flight + 1 of the largest is what is held at the peak;
    # the estimate's reduced shards (and, with host_device, the all-to-all
    # receive buffers) are the communicator's, not counted here. "capped":
    # stage3_max_live_parameters of two units leaves room for one prefetched
    # unit beside the one in use (the window would hold two), and
    # reduce_in_fp32 makes the bf16 model's buckets and gradient shard fp32.
    world = 2
    capped = fp32_reduction_and_live_cap
    extra = {"reduce_in_fp32": True, "stage3_max_live_parameters": 2 * UNIT_NUMEL}
    reduced_bytes = 4 if capped else 2  # per gradient element in buckets and shard
    gathered_units = 2 if capped else 3  # the unit in use and those prefetched
    for rank_rows in unwrap(run_ranks(world, _measure_buffers, extra if capped else None)):
        for row in rank_rows:
            estimate = zeroshard.estimate(
                UNITS * UNIT_NUMEL,
                world_size=world,
                largest_unit_params=UNIT_NUMEL,
                stages=(row["stage"],),
                reduce_bucket_size=UNIT_NUMEL,
                prefetch_bucket_size=2 * UNIT_NUMEL,
                max_live_parameters=2 * UNIT_NUMEL if capped else 1e9,
                reduce_in_fp32=capped,
            )[0]
            buckets = reduced_bytes * 3 * UNIT_NUMEL  # 2 in flight + 1 filling
            shards = reduced_bytes * 2 * UNIT_NUMEL / world
            print(f"stage {row['stage']}: measured {row}, estimated {estimate}")
            assert estimate["staging_bytes"] == buckets + shards
            assert row["staging"] == buckets
            assert estimate["grad_bytes"] == reduced_bytes * UNITS * UNIT_NUMEL / world
            if row["stage"] == 3:
                assert estimate["working_bytes"] == 2 * gathered_units * UNIT_NUMEL
                assert 2 * UNIT_NUMEL < row["gathered"] <= estimate["working_bytes"]
