"""Per-rank memory of model states under ZeRO stages 0-3 (the arithmetic is in C++).

>>> rows = zeroshard.estimate(num_params=7.5e9, world_size=64)
>>> [round(r["model_state_bytes"] / 1e9, 1) for r in rows]
[120.0, 31.4, 16.6, 1.9]
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import torch  # noqa: F401 - libtorch must be loaded before the extension
from torch import nn

from zeroshard import _C
from zeroshard.rule_choice import class_defaults, make_rule, rule_class

_EMPTY = inspect.Parameter.empty

# estimate()'s defaults for the ZeRO and offload settings: the C++
# EstimateOptions', which are ZeroOptions' and OffloadOptions' own, so the
# estimate of a default ZeroOptimizer follows a changed default.
_DEFAULTS: dict[str, Any] = _C.estimate_defaults()

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_BYTE_UNITS = {
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_count(text: str | float | int) -> float:
    """'7.5B', '350M', '1.3e9' -> a number of parameters."""
    if isinstance(text, int | float):
        return float(text)
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)\s*", text)
    if not match:
        raise ValueError(f"cannot read a parameter count from {text!r}; write e.g. 7.5e9 or 7.5B")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_bytes(text: str | float | int) -> float:
    """'80GB', '24GiB', '8e10' -> bytes."""
    if isinstance(text, int | float):
        return float(text)
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _BYTE_UNITS and unit != "":
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 80GB or 24GiB")
    return float(match.group(1)) * _BYTE_UNITS.get(unit or "b", 1)


def count_model(model: nn.Module) -> tuple[int, int]:
    """(parameters, parameters of the largest stage 3 unit under the default wrap
    policy, :func:`zeroshard.units.plan_units`): tied parameters count once."""
    from zeroshard.units import plan_units

    total = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    largest = max((sum(p.numel() for p in unit.params) for unit in plan_units(model)), default=0)
    return total, largest


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def activation_bytes(
    model: nn.Module,
    micro_batch: int,
    sequence_length: int,
    *,
    precision: str = "mixed16",
    checkpointing: bool | None = None,
    tensor_parallel_size: int = 1,
) -> float | None:
    """Bytes of activations per rank for one micro-batch of a transformer, or None.

    The shape comes from a Hugging Face-style ``model.config`` (``hidden_size``
    or ``n_embd``, ``num_hidden_layers`` or ``n_layer``,
    ``num_attention_heads`` or ``n_head``, ``vocab_size``); None when the
    model has none. ``checkpointing`` defaults to the model's
    ``is_gradient_checkpointing``. The formula is the C++ core's
    ``zeroshard::estimate_activation_bytes`` (Korthikanti et al. 2022).
    """
    config = getattr(model, "config", None)
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _config_value(config, "hidden_size", "n_embd", "d_model")
    heads = _config_value(config, "num_attention_heads", "n_head")
    vocab = _config_value(config, "vocab_size") or 0
    if layers is None or hidden is None or heads is None:
        return None
    if checkpointing is None:
        checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
    return float(
        _C.estimate_activation_bytes(
            layers,
            hidden,
            heads,
            vocab,
            int(sequence_length),
            int(micro_batch),
            2 if precision == "mixed16" else 4,
            bool(checkpointing),
            int(tensor_parallel_size),
        )
    )


def estimate(
    num_params: float | str | None = None,
    *,
    model: nn.Module | None = None,
    world_size: int = 1,
    ranks_per_node: int = 1,
    precision: str = "mixed16",
    optimizer: str | type[torch.optim.Optimizer] = "adamw",
    offload_optimizer: str = "none",
    offload_param: str = "none",
    largest_unit_params: float | None = None,
    stages: Sequence[int] = (0, 1, 2, 3),
    offload_ratio: float = _DEFAULTS["offload_ratio"],
    sub_group_size: float = _DEFAULTS["sub_group_size"],
    nvme_buffer_count: int = _DEFAULTS["nvme_buffer_count"],
    param_max_in_cpu: float = _DEFAULTS["param_max_in_cpu"],
    param_buffer_count: int = _DEFAULTS["param_buffer_count"],
    tensor_parallel_size: int = _DEFAULTS["tensor_parallel_size"],
    pipeline_parallel_size: int = _DEFAULTS["pipeline_parallel_size"],
    activation_bytes: float = _DEFAULTS["activation_bytes"],
    reduce_bucket_size: float = _DEFAULTS["reduce_bucket_size"],
    max_buckets_in_flight: int = _DEFAULTS["max_buckets_in_flight"],
    prefetch_bucket_size: float = _DEFAULTS["prefetch_bucket_size"],
    host_device: bool = _DEFAULTS["host_device"],
    max_live_parameters: float = _DEFAULTS["max_live_parameters"],
    reduce_in_fp32: bool = _DEFAULTS["reduce_in_fp32"],
    swap_gradients: bool = _DEFAULTS["swap_gradients"],
) -> list[dict[str, Any]]:
    """Per-rank bytes of parameters, gradients and optimizer state for each stage.

    Give ``num_params`` or a ``model`` (its parameters and largest unit are
    counted). ``precision``: ``"mixed16"`` (16-bit params/grads, fp32 master)
    or ``"fp32"``. ``optimizer``: ``"adam"``/``"adamw"`` (two states),
    ``"adam_amsgrad"`` (three), ``"sgd_momentum"`` (one) or ``"sgd"``, or an
    elementwise ``torch.optim`` class as ``ZeroOptimizer`` takes it, with its
    default hyper-parameters (``torch.optim.Adagrad``: one state; NAdam:
    three, its per-parameter ``mu_product`` stored per element;
    ``torch.optim.Adafactor``: its factored states from ``model``'s shapes,
    which it then needs). Offload devices: ``"none"``,
    ``"cpu"``, ``"nvme"``; parameter offload applies to stage 3 only and is
    ignored (reported as not applicable) below it. ``offload_ratio`` and
    ``sub_group_size`` are those of optimizer offload (``cpu_bytes_per_node``
    includes its staging buffers, the gradient shard when every sub-group is
    offloaded, and on an accelerator (``host_device`` false) the pinned
    slices of the reductions in flight; with NVMe ``nvme_buffer_count``
    sub-groups of state in host buffers; see ``zeroshard::EstimateOptions``).
    With ``offload_param="nvme"``, ``param_max_in_cpu`` shard elements stay in
    host memory and ``param_buffer_count`` buckets (at most the largest
    unit's shard each) are read ahead: both in ``cpu_bytes_per_node``, the
    rest in ``nvme_bytes_per_node`` (offload_param's max_in_cpu and
    buffer_count). With tensor and pipeline parallelism, ``world_size`` is
    every rank (DP x TP x PP): a rank holds 1/(TP x PP) of the model, ZeRO
    shards it over the DP ranks, and a unit is split TP ways.
    ``activation_bytes`` (per rank, e.g. from :func:`activation_bytes`) is
    added to ``device_bytes``, and so are the buffers of the gradient
    reduction (``staging_bytes``: ``max_buckets_in_flight`` + 1 buckets of
    ``reduce_bucket_size``, a whole unit at stage 3, plus receive buffers when
    ``host_device``: Gloo on a CPU device) and, at stage 3, the units
    gathered at once (``working_bytes``: the largest and those that fit in
    ``prefetch_bucket_size`` and keep the gathered total within
    ``max_live_parameters``) and the step's fp32 transient (``step_bytes``:
    a 16-bit gradient widened a chunk of 4M elements at a time, or a device
    sub-group's with partial offload). Settings left out take the defaults of
    ``ZeroOptimizer`` and its offload sections (the C++ options' own, read
    through ``zeroshard._C.estimate_defaults()``). The bucket arguments are ``ZeroOptimizer``'s
    (``max_live_parameters`` is its ``stage3_max_live_parameters``). With
    ``reduce_in_fp32`` (mixed16 only) the buckets and the gradient shard are
    fp32. ``swap_gradients`` (``offload_optimizer.swap_gradients``; applies
    with NVMe optimizer offload at stages 2-3 and ``offload_ratio`` 1) moves
    the gradient shard to ``nvme_bytes_per_node`` in fp32, leaving
    ``nvme_buffer_count`` 4 MiB blocks of it in ``cpu_bytes_per_node``.
    """
    if model is not None:
        counted, largest = count_model(model)
        num_params = counted if num_params is None else num_params
        largest_unit_params = largest if largest_unit_params is None else largest_unit_params
    if num_params is None:
        raise ValueError("give num_params or model")
    psi = parse_count(num_params)
    optimizer_states = -1
    if not isinstance(optimizer, str):
        rule = make_rule(rule_class(optimizer))
        defaults = {k: v for k, v in class_defaults(optimizer).items() if v is not _EMPTY}
        defaults.setdefault("lr", 1e-3)  # a class without a default lr: any value counts states
        hyperparameters = json.dumps(defaults)
        optimizer_states = len(rule.state_names(hyperparameters))
        factored = getattr(rule, "parameter_states", None)
        if factored is not None and factored([2, 3], hyperparameters):
            # States of shapes of their own (Adafactor's [m, 1] and [1, n]):
            # per element, what the model's shapes make of them.
            if model is None:
                raise ValueError(
                    f"optimizer {optimizer.__name__} keeps states whose size depends on each "
                    "parameter's shape; give model= to count them"
                )
            kept = sum(
                math.prod(sizes)
                for p in model.parameters()
                for _, sizes in factored(list(p.shape), hyperparameters)
            )
            optimizer_states += kept / max(sum(p.numel() for p in model.parameters()), 1)
        optimizer = "adamw"  # the recipe's other bytes; its states are counted above
    largest = float(largest_unit_params or 0.0)
    rows = []
    for stage in stages:
        param_offload = offload_param if stage == 3 else "none"
        optimizer_offload = offload_optimizer if stage >= 1 else "none"
        row = dict(
            _C.estimate_memory(
                stage,
                psi,
                largest,
                world_size,
                ranks_per_node,
                precision,
                optimizer,
                optimizer_offload,
                param_offload,
                float(offload_ratio),
                float(sub_group_size),
                int(nvme_buffer_count),
                float(param_max_in_cpu),
                int(param_buffer_count),
                int(tensor_parallel_size),
                int(pipeline_parallel_size),
                float(activation_bytes),
                float(reduce_bucket_size),
                int(max_buckets_in_flight),
                float(prefetch_bucket_size),
                bool(host_device),
                float(max_live_parameters),
                bool(reduce_in_fp32),
                bool(swap_gradients),
                optimizer_states,
            )
        )
        row["model_state_bytes"] = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
        row["offload_optimizer"] = optimizer_offload
        row["offload_param"] = param_offload
        rows.append(row)
    return rows


def estimate_traffic(
    num_params: float | str,
    *,
    world_size: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    precision: str = "mixed16",
    layers: int = 0,
    hidden: int = 0,
    sequence_length: int = 0,
    micro_batch: int = 0,
    bytes_per_value: int = 2,
    checkpointing: bool = False,
    micro_batches: int = 1,
    stages: Sequence[int] = (0, 1, 2, 3),
) -> list[dict[str, Any]]:
    """Bytes one rank sends per optimizer step, per stage and per group.

    ``data_parallel_bytes``: ZeRO's collectives over the data-parallel ranks
    (2Ψ for stages 0-2, 3Ψ at stage 3, of the 1/(TP x PP) model slice a rank
    holds, times (DP-1)/DP for ring collectives; at stage 3 parameters are
    gathered in every micro-batch's forward and backward, gradients reduced
    once a step; zeroshard's prefetch window keeps units the backward reuses
    gathered, which moves less). ``tensor_parallel_bytes`` (needs the shape: ``layers``,
    ``hidden``, ``sequence_length``, ``micro_batch``): two activation
    all-reduces per layer forward, two backward, two more with
    ``checkpointing``, per micro-batch. ``pipeline_parallel_bytes``: a
    stage's activation sends forward and gradient sends back per micro-batch
    (both ways for a stage in the middle). ``micro_batches``: per step and
    rank. Also the data-parallel collectives' full sizes as ``comm_stats()``
    counts them (``reduce_scatter_bytes``, ``all_gather_bytes``,
    ``all_reduce_bytes``). See
    ``zeroshard::estimate_traffic``.
    """
    psi = parse_count(num_params)
    return [
        dict(
            _C.estimate_traffic(
                stage,
                psi,
                int(world_size),
                int(tensor_parallel_size),
                int(pipeline_parallel_size),
                precision,
                int(layers),
                int(hidden),
                int(sequence_length),
                int(micro_batch),
                int(bytes_per_value),
                bool(checkpointing),
                int(micro_batches),
            )
        )
        for stage in stages
    ]


def deepspeed_estimate(
    stage: int,
    num_params: float,
    *,
    world_size: int,
    ranks_per_node: int = 1,
    largest_unit_params: float = 0.0,
    offload_optimizer: str = "none",
    offload_param: str = "none",
) -> dict[str, float]:
    """DeepSpeed's own estimator formulas (stages 2 and 3), for comparison."""
    return dict(
        _C.deepspeed_estimate(
            stage,
            parse_count(num_params),
            float(largest_unit_params),
            world_size,
            ranks_per_node,
            offload_optimizer,
            offload_param,
        )
    )


def recommend(
    num_params: float | str,
    *,
    device_memory: float | str,
    world_size: int,
    ranks_per_node: int = 1,
    precision: str = "mixed16",
    optimizer: str = "adamw",
    largest_unit_params: float = 0.0,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> dict[str, Any]:
    """The cheapest configuration whose per-rank device memory fits, and why.

    With tensor or pipeline parallel degrees, as in :func:`estimate`: a rank
    holds 1/(TP x PP) of the model and ZeRO shards that over the
    world_size / (TP x PP) data-parallel ranks.
    """
    return dict(
        _C.recommend_configuration(
            parse_count(num_params),
            float(largest_unit_params),
            world_size,
            ranks_per_node,
            precision,
            optimizer,
            parse_bytes(device_memory),
            tensor_parallel_size,
            pipeline_parallel_size,
        )
    )


def plot(
    path: str,
    num_params: float | str,
    *,
    world_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
    device_memory: float | str | None = None,
    **options: Any,
) -> None:
    """Draws per-rank device memory against the number of ranks, one line per stage."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from error
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for stage in (0, 1, 2, 3):
        values = [
            estimate(num_params, world_size=n, stages=(stage,), **options)[0]["device_bytes"] / 1e9
            for n in world_sizes
        ]
        axes.plot(world_sizes, values, marker="o", label=f"stage {stage}")
    if device_memory is not None:
        capacity = parse_bytes(device_memory) / 1e9
        axes.axhline(capacity, color="black", linestyle="--", label=f"device {capacity:.0f} GB")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("data-parallel ranks")
    axes.set_ylabel("per-rank device memory for model states (GB)")
    axes.set_title(
        f"{parse_count(num_params) / 1e9:.2f}B parameters, "
        f"{options.get('precision', 'mixed16')}, {options.get('optimizer', 'adamw')}"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of estimate() rows, in GB (1e9 bytes)."""
    header = (
        f"{'stage':>5} {'params':>10} {'grads':>10} {'optimizer':>10} {'working':>10} "
        f"{'staging':>10} {'device':>10} {'cpu/node':>10} {'nvme/node':>10}"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['stage']:>5} {r['param_bytes'] / 1e9:>10.2f} {r['grad_bytes'] / 1e9:>10.2f} "
            f"{r['optimizer_bytes'] / 1e9:>10.2f} {r['working_bytes'] / 1e9:>10.2f} "
            f"{r['staging_bytes'] / 1e9:>10.2f} {r['device_bytes'] / 1e9:>10.2f} "
            f"{r['cpu_bytes_per_node'] / 1e9:>10.2f} {r['nvme_bytes_per_node'] / 1e9:>10.2f}"
        )
    return "\n".join(lines)


__all__ = [
    "activation_bytes",
    "count_model",
    "deepspeed_estimate",
    "estimate",
    "format_table",
    "parse_bytes",
    "parse_count",
    "plot",
    "recommend",
]
