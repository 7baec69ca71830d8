"""Offload settings: DeepSpeed's ``offload_optimizer`` / ``offload_param`` sections.

The C++ core (``zeroshard::OffloadOptions``) checks the values; this module
only turns the Python forms (a device name or a dict) into its keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zeroshard import _C

# Each section's keys with the core's defaults, and DeepSpeed's keys it accepts
# so that a DeepSpeed section can be passed unchanged and does not use: from
# the core's one list ([Note: one list of the offload keys] in
# offload_options.h). A value takes its default's type.
_KEYS: dict[str, dict[str, Any]] = _C.offload_option_keys()
_IGNORED: dict[str, list[str]] = _C.offload_ignored_keys()


def _allowed(which: str) -> set[str]:
    return set(_KEYS[which]) | set(_IGNORED[which])


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
    allowed = _allowed(which)
    unknown = set(value) - allowed
    if unknown:
        raise TypeError(f"unknown {which} key(s) {sorted(unknown)}; expected {sorted(allowed)}")
    defaults = _KEYS[which]
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key in _IGNORED[which]:
            continue
        if key in ("device", "nvme_path") and item is None:
            out[key] = defaults[key]
        else:
            out[key] = type(defaults[key])(item)
    out.setdefault("device", defaults["device"])
    if which == "offload_param":
        # DeepSpeed's default for this section (offload_optimizer's differs).
        out.setdefault("buffer_count", defaults["buffer_count"])
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
    allowed = _allowed("aio")
    unknown = set(value) - allowed
    if unknown:
        raise TypeError(f"unknown aio key(s) {sorted(unknown)}; expected {sorted(allowed)}")
    return {key: type(_KEYS["aio"][key])(item) for key, item in value.items()}
