"""Hybrid sharding (FSDP2's HSDP) on 4 CPU ranks: shard within groups of 2, replicate across.

Every configuration is compared with single-process ``torch.optim`` on the
same global batch, and its traffic with theory: within a shard group the
same collectives as plain ZeRO over those 2 ranks; across replicas only the
gradient shards (Ψ/2 elements per rank, once per step) and the step's
small agreement flags; no parameter all-gather crosses a shard group.
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard

from dist_harness import RankError, run_ranks, unwrap
from tiny_models import (
    VOCAB,
    local_batch,
    make_model,
    max_abs_diff,
    param_groups,
    snapshot,
)

WORLD, SHARD = 4, 2
STEPS = 8
LR = 1e-2
TOLERANCE = 1e-6
CLIP = 0.5


def _loss(model: nn.Module, step: int, rank: int, world_size: int) -> torch.Tensor:
    tokens, targets = local_batch(step, rank, world_size)
    logits = model(tokens, step)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference(steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(param_groups(model, (LR, 2 * LR)), lr=LR)
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, step, 0, 1).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return snapshot(model)


def _groups(how: str) -> dict[str, Any]:
    if how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            "cpu", (WORLD // SHARD, SHARD), mesh_dim_names=("replicate", "shard")
        )
        return {"device_mesh": mesh}
    groups = zeroshard.groups.hybrid_groups(SHARD)
    return {"process_group": groups.shard, "replicate_group": groups.replicate}


def _make(model: nn.Module, stage: int, groups: dict[str, Any], **extra: Any) -> Any:
    return zeroshard.ZeroOptimizer(
        param_groups(model, (LR, 2 * LR)),
        "adamw",
        stage=stage,
        module=model,
        max_norm=CLIP,
        stage3_param_persistence_threshold=0,
        reduce_bucket_size=40,  # several buckets per group
        lr=LR,
        **groups,
        **extra,
    )


_EXTRA = {
    "offload": {"offload_optimizer": "cpu", "sub_group_size": 100},
    # The gradient shard in the NVMe swap space: the replica all-reduce reads
    # it from disk and writes the sum back.
    "nvme_swap": {
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": tempfile.gettempdir(),
            "swap_gradients": True,
        },
        "sub_group_size": 100,
    },
}


def _train(rank: int, world_size: int, stage: int, how: str) -> dict[str, Any]:
    how, _, extra_name = how.partition("+")
    extra = _EXTRA.get(extra_name, {})
    torch.manual_seed(rank)
    model = make_model(seed=0)
    if rank != 0:  # construction starts every rank from global rank 0's values
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    groups = _groups(how)
    optimizer = _make(model, stage, groups, **extra)
    # Plain ZeRO over this rank's shard group alone: the traffic the shard
    # group should see.
    plain_model = make_model(seed=0)
    shard_group = optimizer._process_group
    plain = _make(plain_model, stage, {"process_group": shard_group}, **extra)
    per_step: list[dict[str, Any]] = []
    for step in range(STEPS):
        for opt, net in ((optimizer, model), (plain, plain_model)):
            opt.zero_grad()
            opt.reset_comm_stats()
            _loss(net, step, rank, world_size).backward()
            opt.step()
        per_step.append(
            {
                "shard": optimizer.comm_stats(),
                "replica": optimizer._impl.replica_comm_stats(),
                "plain": plain.comm_stats(),
            }
        )
    with optimizer.gathered_parameters():
        params = snapshot(model)
    swap = optimizer.nvme_stats() or {}
    return {
        "params": params,
        "gradients_written": swap.get("gradients", {}).get("bytes_written", 0),
        "per_step": per_step,
        "shard_numels": [optimizer._impl.shard_numel(g) for g in range(2)],
        "num_params": sum(len(g["params"]) for g in optimizer.param_groups),
        "data_parallel_world_size": optimizer._impl.data_parallel_world_size,
        "shard_world": optimizer._impl.world_size,
    }


_RESULTS: dict[str, list[dict[str, Any]]] = {}


def trained(stage: int, how: str) -> list[dict[str, Any]]:
    key = f"{stage}/{how}"
    if key not in _RESULTS:
        _RESULTS[key] = unwrap(run_ranks(WORLD, _train, stage, how))
    return _RESULTS[key]


@pytest.mark.parametrize(
    ("stage", "how"),
    [
        (1, "groups"),
        (2, "mesh"),
        (3, "mesh"),
        (3, "groups"),
        (2, "mesh+offload"),
        (3, "mesh+nvme_swap"),
    ],
)
def test_hybrid_sharding_matches_torch_optim(stage: int, how: str) -> None:
    results = trained(stage, how)
    expected = reference()
    for rank, r in enumerate(results):
        assert r["shard_world"] == SHARD and r["data_parallel_world_size"] == WORLD
        # With nvme_swap the gradients went through the swap file.
        assert (r["gradients_written"] > 0) == ("nvme_swap" in how), (rank, how)
        diff = max_abs_diff(r["params"], expected)
        print(f"hybrid stage {stage} ({how}) rank {rank}: max abs diff {diff:.3e}")
        assert diff <= TOLERANCE, (rank, diff)
    # Replicas take identical steps: every rank holds the same parameters.
    for r in results[1:]:
        assert max_abs_diff(r["params"], results[0]["params"]) == 0.0


@pytest.mark.parametrize(("stage", "how"), [(1, "groups"), (2, "mesh"), (3, "mesh")])
def test_hybrid_traffic_within_and_across_groups_is_theory(stage: int, how: str) -> None:
    for rank, r in enumerate(trained(stage, how)):
        grad_shard_bytes = 4 * sum(r["shard_numels"])  # fp32 gradient shards
        # The step's flags: presence per parameter, overflow, detached
        # parameters, the hyper-parameters' hash and its complement.
        flag_bytes = 4 * (r["num_params"] + 4)
        for step, stats in enumerate(r["per_step"]):
            shard, replica, plain = stats["shard"], stats["replica"], stats["plain"]
            # Within the shard group: exactly plain ZeRO over its 2 ranks.
            for kind in ("reduce_scatter_bytes", "all_gather_bytes", "broadcast_bytes"):
                assert shard[kind] == plain[kind], (rank, step, kind, shard[kind], plain[kind])
            assert shard["all_reduce_bytes"] == plain["all_reduce_bytes"], (rank, step)
            # Across replicas: the gradient shard once, the flags; no all-gather.
            assert replica["all_gather_bytes"] == 0 and replica["reduce_scatter_bytes"] == 0
            assert replica["all_reduce_bytes"] == grad_shard_bytes + flag_bytes, (
                rank,
                step,
                replica["all_reduce_bytes"],
                grad_shard_bytes,
                flag_bytes,
            )
        if rank == 0:
            last = r["per_step"][-1]
            print(
                f"stage {stage} per step: shard group {last['shard']}, "
                f"replicas {last['replica']} (gradient shard {grad_shard_bytes} B)"
            )


# ---- Engine: DeepSpeed's zero_hpz_partition_size --------------------------------------


def _engine(rank: int, world_size: int, hpz: int) -> dict[str, Any]:
    model = make_model(seed=0)
    config = {
        "train_micro_batch_size_per_gpu": 12 // world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "zero_hpz_partition_size": hpz,
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, optimizer, _, _ = zeroshard.initialize(
        model=model, model_parameters=param_groups(model, (LR, 2 * LR)), config=config
    )
    for step in range(STEPS):
        engine.backward(_loss(engine, step, rank, world_size))
        engine.step()
    with optimizer.gathered_parameters():
        params = snapshot(model)
    return {"params": params, "shard_world": optimizer._impl.world_size}


def _engine_rng(rank: int, world_size: int, path: str, resume: bool) -> dict[str, Any]:
    import random

    model = make_model(seed=0)
    config = {
        "train_micro_batch_size_per_gpu": 12 // world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 2, "zero_hpz_partition_size": SHARD},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    if resume:
        torch.manual_seed(12345)  # the load must replace this
        random.seed(12345)
        engine.load_checkpoint(path)
    else:
        torch.manual_seed(100 + rank)  # every rank its own streams, as with dropout
        random.seed(100 + rank)
        engine.backward(_loss(engine, 0, rank, world_size))
        engine.step()
        engine.save_checkpoint(path)
    return {"torch": torch.rand(3), "python": random.random()}


def test_every_replica_resumes_its_own_random_streams(tmp_path) -> None:
    # Only the first replica writes data files, but every rank's RNG states
    # reach the checkpoint (through its first-replica counterpart).
    saved = unwrap(run_ranks(WORLD, _engine_rng, str(tmp_path), False))
    resumed = unwrap(run_ranks(WORLD, _engine_rng, str(tmp_path), True))
    for rank in range(WORLD):
        assert torch.equal(resumed[rank]["torch"], saved[rank]["torch"]), rank
        assert resumed[rank]["python"] == saved[rank]["python"], rank
    assert len({float(r["torch"][0]) for r in saved}) == WORLD  # four streams, not two
    names = {p.name for p in (tmp_path / "global_step1").iterdir()}
    assert {f"rng_state_{r}.pt" for r in range(WORLD)} <= names, names
    assert {f"rng_cpu_{r}.bin" for r in range(WORLD)} <= names, names


def test_engine_zero_hpz_partition_size_is_hybrid_sharding() -> None:
    results = unwrap(run_ranks(WORLD, _engine, SHARD))
    expected = reference()
    for rank, r in enumerate(results):
        assert r["shard_world"] == SHARD
        diff = max_abs_diff(r["params"], expected)
        print(f"engine hpz={SHARD} rank {rank}: max abs diff {diff:.3e}")
        assert diff <= TOLERANCE, (rank, diff)


def test_hpz_that_does_not_divide_the_world_is_an_error_on_every_rank() -> None:
    results = run_ranks(WORLD, _engine, 3)
    for r in results:
        assert isinstance(r, RankError), r
        assert "zero_hpz_partition_size = 3 must divide the world size 4" in r.message, r.message


def _named_mesh(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _make(make_model(seed=0), 2, {"device_mesh": mesh})


def test_a_2d_mesh_that_is_not_replicate_shard_is_refused_naming_its_dimensions() -> None:
    for r in run_ranks(WORLD, _named_mesh):
        assert isinstance(r, RankError), r
        assert "('dp', 'tp')" in r.message and 'mesh["dp"]' in r.message, r.message


# ---- Checkpoints ---------------------------------------------------------------------


def _resume(rank: int, world_size: int, path: str, async_save: bool = False) -> dict[str, Any]:
    groups = _groups("groups")
    model = make_model(seed=0)
    optimizer = _make(model, 3, groups)
    for step in range(STEPS):
        if step == 4:
            # Asynchronous: the steps below run while the first replica writes
            # the state of the call.
            optimizer.save_checkpoint(path, async_save=async_save)
        optimizer.zero_grad()
        _loss(model, step, rank, world_size).backward()
        optimizer.step()
    # Every rank learns the outcome, the replicas that wrote nothing too.
    optimizer.wait_for_checkpoint()
    with optimizer.gathered_parameters():
        uninterrupted = snapshot(model)
    # Resume hybrid (same groups) and plain (sharded over all 4 ranks).
    resumed = make_model(seed=1)
    again = _make(resumed, 3, groups)
    again.load_checkpoint(path)
    for step in range(4, STEPS):
        again.zero_grad()
        _loss(resumed, step, rank, world_size).backward()
        again.step()
    with again.gathered_parameters():
        hybrid_resumed = snapshot(resumed)
    # An edit on global rank 0 (modifier rank 0 of the first replica) reaches
    # every replica.
    with again.gathered_parameters(modifier_rank=0), torch.no_grad():
        if rank == 0:
            resumed.fc1.weight.fill_(0.25)
    with again.gathered_parameters():
        edited = resumed.fc1.weight.detach().clone()
    plain_model = make_model(seed=2)
    plain = _make(plain_model, 2, {"process_group": dist.group.WORLD})
    plain.load_checkpoint(path)
    return {
        "uninterrupted": uninterrupted,
        "hybrid_resumed": hybrid_resumed,
        "plain_loaded": snapshot(plain_model),
        "edited": edited,
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_hybrid_checkpoint_resumes_bitwise_and_loads_unsharded(tmp_path, async_save) -> None:
    results = unwrap(run_ranks(WORLD, _resume, str(tmp_path / "ckpt"), async_save))
    saved_at_4 = reference(steps=4)
    for rank, r in enumerate(results):
        assert max_abs_diff(r["hybrid_resumed"], r["uninterrupted"]) == 0.0, rank
        assert torch.equal(r["edited"], torch.full_like(r["edited"], 0.25)), rank
        diff = max_abs_diff(r["plain_loaded"], saved_at_4)
        print(f"rank {rank}: plain stage 2 over 4 ranks loaded the hybrid checkpoint, {diff:.3e}")
        assert diff <= TOLERANCE, (rank, diff)
    # One replica wrote the shards: one rank file per shard-group rank.
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("rank"))
    assert len(files) == SHARD, files


def _replicas_read_different_checkpoints(rank: int, world_size: int, root: str) -> str:
    groups = _groups("groups")
    model = make_model(seed=0)
    optimizer = _make(model, 2, groups)
    for step in range(2):
        optimizer.zero_grad()
        _loss(model, step, rank, world_size).backward()
        optimizer.step()
        optimizer.save_checkpoint(os.path.join(root, f"step{step}"))
    # What a node whose file system lags behind sees: replica 1 (ranks 2 and
    # 3) reads the older checkpoint. Each replica's ranks agree among
    # themselves; only a comparison across replicas tells the two apart.
    before = snapshot(model)
    older = rank >= SHARD
    try:
        optimizer.load_checkpoint(os.path.join(root, "step0" if older else "step1"))
    except ValueError as error:
        assert max_abs_diff(snapshot(model), before) == 0.0  # nothing was loaded
        return str(error)
    return ""


def test_replicas_that_read_different_checkpoints_fail_together_loading_nothing(
    tmp_path,
) -> None:
    # Before, the index was compared within each replica only: both replicas
    # loaded, each its own step, and went on training apart.
    for rank, message in enumerate(
        unwrap(run_ranks(WORLD, _replicas_read_different_checkpoints, str(tmp_path)))
    ):
        assert "the ranks read different index.json files for checkpoint" in message, (
            rank,
            message,
        )


# ---- Groups that do not make replicas ------------------------------------------------


def test_replicate_group_without_its_shard_group_is_refused() -> None:
    with pytest.raises(ValueError, match="replicate_group= needs process_group="):
        zeroshard.groups.data_parallel_groups(replicate_group=object())


def _crossed(rank: int, world_size: int) -> str:
    # Shard groups {0, 1} and {2, 3}, but "replicas" {0, 3} and {1, 2}: each
    # pairs shard ranks 0 and 1, which hold different elements.
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    shard = shards[rank // 2]
    replicate = crossed[0] if rank in (0, 3) else crossed[1]
    try:
        _make(make_model(seed=0), 2, {"process_group": shard, "replicate_group": replicate})
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_replicate_group_of_other_shard_positions_is_an_error_on_every_rank() -> None:
    for rank, message in enumerate(run_ranks(WORLD, _crossed)):
        print(f"rank {rank}: {message}")
        assert "replicate_group must hold one rank per shard group" in message or (
            "another rank failed to check its replicate group" in message
        ), message


def _async_failure(rank: int, world_size: int, path: str) -> str:
    optimizer = _make(make_model(seed=0), 2, _groups("groups"))
    # The first replica's writers cannot create the directory (a file where
    # its parent should be): the call raises on every rank, the replicas that
    # write nothing too, and no write is left in flight.
    try:
        optimizer.save_checkpoint(path, async_save=True)
        optimizer.wait_for_checkpoint()
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_failed_async_save_with_hybrid_sharding_is_an_error_on_every_rank(tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory")
    path = str(tmp_path / "file" / "ckpt")
    for rank, message in enumerate(run_ranks(WORLD, _async_failure, path)):
        print(f"rank {rank}: {message}")
        assert "could not" in message and "ckpt" in message, (rank, message)


def _async_one_rank_shards(rank: int, world_size: int, path: str) -> str:
    # Shard groups of one rank: the writer commits without an agreement, and
    # still posts the outcome its replica waits for.
    groups = zeroshard.groups.hybrid_groups(1)
    model = make_model(seed=0)
    optimizer = _make(
        model, 2, {"process_group": groups.shard, "replicate_group": groups.replicate}
    )
    optimizer.zero_grad()
    _loss(model, 0, rank, world_size).backward()
    optimizer.step()
    optimizer.save_checkpoint(path, async_save=True)
    optimizer.wait_for_checkpoint()
    return "saved"


def test_async_save_with_one_rank_shard_groups_reaches_every_replica(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    assert run_ranks(2, _async_one_rank_shards, path, timeout=120) == ["saved", "saved"]
    assert zeroshard.checkpoint.read_index(path)["world_size"] == 1


def _fill(directory: str) -> None:
    """Writes a file into ``directory`` until the file system is full."""
    # Unbuffered: a buffered tail would raise again, outside the loop, at close.
    with open(os.path.join(directory, "filler"), "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        try:
            while True:
                f.write(chunk)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error


def _save_to_a_full_disk(
    rank: int, world_size: int, disk: str, how: str, then: str = "wait"
) -> dict[str, Any]:
    groups = _groups("groups") if how == "hybrid" else {}
    model = make_model(seed=0)
    optimizer = _make(model, 3, groups)
    for step in range(STEPS):
        if step == 2:
            optimizer.save_checkpoint(os.path.join(disk, "first"))
            with optimizer.gathered_parameters():
                saved = snapshot(model)
            if rank == 0:
                _fill(disk)
            dist.barrier()
        if step == 4:
            # Accepted (the staging directory needs no data block); the writes
            # fail on the background thread while the steps below run.
            optimizer.save_checkpoint(os.path.join(disk, "second"), async_save=True)
        optimizer.zero_grad()
        _loss(model, step, rank, world_size).backward()
        optimizer.step()
    try:
        if then == "wait":
            optimizer.wait_for_checkpoint()
        else:
            # The next save, refused for its rank file names: every replica
            # gives "rng.pt". The refusal must not hide the failed save.
            optimizer._impl.save_checkpoint(
                os.path.join(disk, "third"), rank_files={"rng.pt": b"x"}
            )
        error = "no error"
    except ValueError as e:
        error = str(e)
    # Reported once: nothing is pending any more.
    optimizer.wait_for_checkpoint()
    # The previous checkpoint is whole: it loads, on a full disk too.
    resumed = make_model(seed=1)
    again = _make(resumed, 3, groups)
    again.load_checkpoint(os.path.join(disk, "first"))
    with again.gathered_parameters():
        loaded = snapshot(resumed)
    return {"error": error, "saved": saved, "loaded": loaded}


@pytest.mark.parametrize("how", ["plain", "hybrid"])
def test_an_async_save_that_fails_in_the_background_is_an_error_on_every_rank(
    small_disk, how
) -> None:
    world_size = 2 if how == "plain" else WORLD
    results = unwrap(run_ranks(world_size, _save_to_a_full_disk, str(small_disk), how, timeout=120))
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r['error']}")
        # With hybrid sharding ranks 2 and 3 write nothing: they learn the
        # writers' failure from the outcome rank 0 posts.
        assert "the asynchronous save of checkpoint" in r["error"], (rank, r["error"])
        assert "second" in r["error"] and "No space left on device" in r["error"], r["error"]
        assert max_abs_diff(r["loaded"], r["saved"]) == 0.0, rank
    assert not (small_disk / "second").exists()
    assert (small_disk / "first" / "index.json").exists()


def test_a_refused_save_also_reports_the_previous_async_save_failure_on_every_rank(
    small_disk,
) -> None:
    # Hybrid sharding: ranks 2 and 3 observe the failed save. Their earlier
    # outcome used to be dropped when the rank-file-name refusal raised first.
    results = unwrap(
        run_ranks(WORLD, _save_to_a_full_disk, str(small_disk), "hybrid", "clash", timeout=120)
    )
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r['error']}")
        assert "rank file 'rng.pt' is given by two replicas" in r["error"], (rank, r["error"])
        assert "the asynchronous save of checkpoint" in r["error"], (rank, r["error"])
        assert "No space left on device" in r["error"], (rank, r["error"])
        # Reported by both replicas: the writers (ranks 0 and 1) from their own
        # writes, the observers (2 and 3) from the outcome the writers posted.
        assert r["error"].count("the asynchronous save of checkpoint") == 2, (rank, r["error"])
        assert max_abs_diff(r["loaded"], r["saved"]) == 0.0, rank
    assert not (small_disk / "second").exists()
    assert not (small_disk / "third").exists()
