"""The command-line arguments of the benchmark GPTs, shared by the scripts that build them.

Two shapes: the peer benchmarks' small GPT (run_benchmarks, bench_paired,
bench_checkpoint) and the capacity benchmarks' wide one, whose parameter
count the depth sets (bench_capacity, bench_largest).
"""

from __future__ import annotations

import argparse


def add_gpt_arguments(parser: argparse.ArgumentParser) -> None:
    """The ranks, the small GPT and its global batch."""
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)


def add_capacity_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """The wide GPT (its depth is the caller's), its batch and the NVMe swap settings."""
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--nvme-path", default="/var/tmp")
    parser.add_argument("--sub-group-size", type=int, default=25_000_000)
    parser.add_argument("--buffer-count", type=int, default=4)
