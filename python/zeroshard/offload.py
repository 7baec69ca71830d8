"""Offload settings: DeepSpeed's ``offload_optimizer`` / ``offload_param`` sections.

The C++ core (``zeroshard::OffloadOptions``) checks the values; this module
only turns the Python forms (a device name or a dict) into its keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zeroshard import _C

# DeepSpeed's keys of each section that zeroshard reads; the NVMe tuning keys
# are accepted so that a DeepSpeed section can be passed unchanged.
_OPTIMIZER_KEYS = {
    "device",
    "pin_memory",
    "ratio",
    "buffer_count",
    "nvme_path",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "swap_gradients",
}
_PARAM_KEYS = {"device", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "nvme_path"}
_IGNORED = {"fast_init"}  # DeepSpeed's NVMe initialization shortcut
_AIO_KEYS = {
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "thread_count",
    "single_submit",
    "overlap_events",
    "use_io_uring",
}


def offload_options(value: str | Mapping[str, Any] | None, which: str) -> dict[str, Any]:
    """Normalises ``offload_optimizer=`` / ``offload_param=`` to the core's keys.

    Args:
        value: None, a device name (``"none"``, ``"cpu"``, ``"nvme"``) or a
            mapping with DeepSpeed's keys for that section.
        which: ``"offload_optimizer"`` or ``"offload_param"``, for messages.

    Raises:
        TypeError: for a value of another type or an unknown key.
    """
    if value is None:
        return {"device": "none"}
    if isinstance(value, str):
        return {"device": value}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{which} must be None, a device name ('none', 'cpu', 'nvme') or a dict of "
            f"DeepSpeed's {which} keys; got {type(value).__name__}"
        )
    allowed = _OPTIMIZER_KEYS if which == "offload_optimizer" else _PARAM_KEYS
    unknown = set(value) - allowed
    if unknown:
        raise TypeError(f"unknown {which} key(s) {sorted(unknown)}; expected {sorted(allowed)}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key in _IGNORED:
            continue
        if key == "device":
            out[key] = "none" if item is None else str(item)
        elif key in ("pin_memory", "pipeline_read", "pipeline_write", "swap_gradients"):
            out[key] = bool(item)
        elif key == "ratio":
            out[key] = float(item)
        elif key == "nvme_path":
            out[key] = "" if item is None else str(item)
        else:
            out[key] = int(item)
    out.setdefault("device", "none")
    if which == "offload_param":
        # DeepSpeed's default for this section (offload_optimizer's is 4).
        out.setdefault("buffer_count", _C.OFFLOAD_PARAM_BUFFER_COUNT)
    return out


def aio_options(value: Mapping[str, Any] | None) -> dict[str, Any]:
    """Normalises ``aio=`` (DeepSpeed's ``aio`` section) to the core's keys.

    Raises:
        TypeError: for a value that is not a mapping, or an unknown key.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"aio must be a dict of DeepSpeed's aio keys; got {type(value).__name__}")
    unknown = set(value) - _AIO_KEYS
    if unknown:
        raise TypeError(f"unknown aio key(s) {sorted(unknown)}; expected {sorted(_AIO_KEYS)}")
    return {
        key: bool(item) if key in ("single_submit", "overlap_events", "use_io_uring") else int(item)
        for key, item in value.items()
    }
