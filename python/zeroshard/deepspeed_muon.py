"""DeepSpeed's ``"optimizer": {"type": "Muon"}``, as parameter groups of one ZeroOptimizer.

DeepSpeed runs it as ``MuonWithAuxAdam``: each parameter marked ``use_muon``
takes Muon, the others an Adam. ``deepspeed.initialize`` marks those with two
or more dimensions whose name holds neither ``"embed"`` nor ``"lm_head"``.
Here a ``use_muon`` attribute the user set on a parameter is kept, and the
others are marked by that rule. Each incoming group is split into its Muon
half (``torch.optim.Muon`` with Nesterov momentum and the ``"original"`` lr
adjustment, which is DeepSpeed's ``muon_update``) and its Adam half
(``torch.optim.AdamW``, or ``torch.optim.Adam`` with ``"adam_w_mode": false``),
a group's own ``lr``/``weight_decay``/... over the config's, as DeepSpeed
resolves them. The config's values are read in C++ (``[Note: DeepSpeed's
Muon]`` in ``optimizer_config.cpp``); every matrix is then updated whole by one
rank (``[Note: whole parameters]``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from zeroshard import _C

# The keys each half takes from a group, as DeepSpeed's engine
# (_MUON_HALF_KEYS, _ADAM_HALF_KEYS; ns_method picks a kernel, not a value).
_MUON_KEYS = ("lr", "momentum", "weight_decay")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """Whether DeepSpeed's Muon updates ``param`` with Muon: its ``use_muon``
    attribute where set, else two or more dimensions and a name without
    ``"embed"`` or ``"lm_head"`` (DeepSpeed's ``set_optimizer_flags``)."""
    marked = getattr(param, "use_muon", None)
    if marked is not None:
        return bool(marked)
    return _C.uses_deepspeed_muon(name, param.dim())


def muon_param_groups(
    model: nn.Module,
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    hyperparameters: dict[str, Any],
) -> list[dict[str, Any]]:
    """``params`` (tensors or groups) split into Muon and Adam groups.

    ``hyperparameters``: the config's resolved values, ``{"muon": {...},
    "adam": {...}, "adam_w_mode": bool}``. Raises ``ValueError`` naming a
    parameter marked for Muon that is not a matrix.
    """
    names: dict[torch.Tensor, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, name)
    groups: list[dict[str, Any]] = []
    loose: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            groups.append(item)
        else:
            loose.append(item)
    if loose or not groups:
        groups.append({"params": loose})
    muon_class = torch.optim.Muon
    adam_class = torch.optim.AdamW if hyperparameters["adam_w_mode"] else torch.optim.Adam
    muon_defaults = dict(hyperparameters["muon"], nesterov=True, adjust_lr_fn="original")
    adam_defaults = dict(hyperparameters["adam"])
    adam_defaults["betas"] = tuple(adam_defaults["betas"])
    halves: list[dict[str, Any]] = []
    for group in groups:
        members = list(group["params"])
        muon: list[torch.Tensor] = []
        adam: list[torch.Tensor] = []
        for param in members:
            name = names.get(param, f"<parameter of shape {tuple(param.shape)}>")
            if not uses_muon(name, param):
                adam.append(param)
            elif param.dim() != 2:
                raise ValueError(
                    f'optimizer.type "Muon": {name} has shape {tuple(param.shape)}; zeroshard '
                    "orthogonalises 2-D parameters only (DeepSpeed reshapes others to a matrix). "
                    "Set its use_muon attribute to False to train it with the Adam half"
                )
            else:
                muon.append(param)
        for half, cls, defaults, keys in (
            (muon, muon_class, muon_defaults, _MUON_KEYS),
            (adam, adam_class, adam_defaults, _ADAM_KEYS),
        ):
            if half:
                own = {key: group[key] for key in keys if key in group}
                halves.append({**defaults, **own, "params": half, "optimizer": cls})
    return halves
