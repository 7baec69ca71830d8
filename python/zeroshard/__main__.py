"""Command line: ``python -m zeroshard estimate ...`` and ``... consolidate ...``."""

from __future__ import annotations

import argparse
import sys

from zeroshard.estimator import (
    estimate,
    estimate_traffic,
    format_table,
    parse_count,
    plot,
    recommend,
)


def _estimate_command(args: argparse.Namespace) -> int:
    options = {"precision": args.precision, "optimizer": args.optimizer}
    rows = estimate(
        args.params,
        world_size=args.world_size,
        ranks_per_node=args.ranks_per_node,
        offload_optimizer=args.offload_optimizer,
        offload_param=args.offload_param,
        largest_unit_params=parse_count(args.largest_unit),
        tensor_parallel_size=args.tensor_parallel,
        pipeline_parallel_size=args.pipeline_parallel,
        **options,
    )
    degrees = (
        f", TP {args.tensor_parallel} x PP {args.pipeline_parallel}"
        if args.tensor_parallel * args.pipeline_parallel > 1
        else ""
    )
    print(
        f"{parse_count(args.params) / 1e9:.3f}B parameters, {args.world_size} ranks "
        f"({args.ranks_per_node} per node{degrees}), {args.precision}, {args.optimizer}; "
        f"GB (1e9 bytes) per rank unless per node"
    )
    print(format_table(rows))
    traffic = estimate_traffic(
        args.params,
        world_size=args.world_size,
        tensor_parallel_size=args.tensor_parallel,
        pipeline_parallel_size=args.pipeline_parallel,
        precision=args.precision,
        layers=args.layers,
        hidden=args.hidden,
        sequence_length=args.sequence_length,
        micro_batch=args.micro_batch,
        micro_batches=args.micro_batches,
    )
    print("sent per rank per step, GB: " + "; ".join(_traffic_text(row) for row in traffic))
    if args.device_memory:
        advice = recommend(
            args.params,
            device_memory=args.device_memory,
            world_size=args.world_size,
            ranks_per_node=args.ranks_per_node,
            largest_unit_params=parse_count(args.largest_unit),
            tensor_parallel_size=args.tensor_parallel,
            pipeline_parallel_size=args.pipeline_parallel,
            **options,
        )
        print(("recommendation: " if advice["fits"] else "no fit: ") + advice["reason"])
    if args.plot:
        plot(
            args.plot,
            args.params,
            device_memory=args.device_memory or None,
            largest_unit_params=parse_count(args.largest_unit),
            **options,
        )
        print(f"plot written to {args.plot}")
    return 0


def _traffic_text(row: dict) -> str:
    parts = [f"DP {row['data_parallel_bytes'] / 1e9:.3g}"]
    for key, name in (("tensor_parallel_bytes", "TP"), ("pipeline_parallel_bytes", "PP")):
        if row[key]:
            parts.append(f"{name} {row[key] / 1e9:.3g}")
    return f"stage {row['stage']} " + " + ".join(parts)


def _consolidate_command(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import consolidate

    files = consolidate(
        args.checkpoint,
        args.output_dir,
        tag=args.tag,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
    )
    for path in files:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroshard")
    commands = parser.add_subparsers(dest="command", required=True)
    est = commands.add_parser("estimate", help="per-rank memory of model states by ZeRO stage")
    est.add_argument("--params", required=True, help="parameter count, e.g. 7.5e9 or 7.5B")
    est.add_argument("--world-size", type=int, required=True, help="all ranks: DP x TP x PP")
    est.add_argument("--tensor-parallel", type=int, default=1, help="TP degree")
    est.add_argument("--pipeline-parallel", type=int, default=1, help="PP degree")
    est.add_argument("--ranks-per-node", type=int, default=1)
    est.add_argument("--precision", default="mixed16", choices=["mixed16", "fp32"])
    est.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adam", "adamw", "adam_amsgrad", "sgd_momentum", "sgd"],
    )
    est.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"])
    est.add_argument("--offload-param", default="none", choices=["none", "cpu", "nvme"])
    est.add_argument(
        "--largest-unit",
        default="0",
        help="parameters of the largest gathered unit (stage 3 working set)",
    )
    est.add_argument("--device-memory", default="", help="e.g. 80GB: also recommend a config")
    # The transformer's shape, for the TP and PP traffic figures.
    est.add_argument("--layers", type=int, default=0)
    est.add_argument("--hidden", type=int, default=0)
    est.add_argument("--sequence-length", type=int, default=0)
    est.add_argument("--micro-batch", type=int, default=0)
    est.add_argument("--micro-batches", type=int, default=1, help="per step and rank")
    est.add_argument("--plot", default="", help="write a PNG of memory against ranks")
    con = commands.add_parser(
        "consolidate",
        help="write a checkpoint's weights as Hugging Face safetensors (streaming)",
    )
    con.add_argument("checkpoint", help="a checkpoint directory, or a save_dir with `latest`")
    con.add_argument("output_dir")
    con.add_argument("--tag", default=None, help="the tag under CHECKPOINT (default: latest)")
    con.add_argument(
        "--dtype",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="output dtype (default: each parameter's training dtype)",
    )
    con.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB")
    args = parser.parse_args(argv)
    if args.command == "estimate":
        return _estimate_command(args)
    if args.command == "consolidate":
        return _consolidate_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
