"""zeroshard: ZeRO (Zero Redundancy Optimizer) stages over c10d, with a C++ core.

The work happens in C++ (``zeroshard._C``); this package is a thin,
idiomatic layer over it.
"""

from zeroshard.checkpoint import consolidate, consolidated_state_dict
from zeroshard.clipping import clip_grad_norm_, route_torch_clip_grad_norm
from zeroshard.engine import Engine, initialize
from zeroshard.estimator import estimate, estimate_traffic, recommend
from zeroshard.grad_scaler import route_grad_scaler_unscale
from zeroshard.optimizer import ZeroOptimizer
from zeroshard.teardown import release_pinned_default_groups
from zeroshard.units import set_leaf_modules

release_pinned_default_groups()
route_torch_clip_grad_norm()  # [Note: torch's clip_grad_norm_ routed]
route_grad_scaler_unscale()  # [Note: GradScaler's unscale_ routed]

__all__ = [
    "Engine",
    "ZeroOptimizer",
    "clip_grad_norm_",
    "consolidate",
    "consolidated_state_dict",
    "estimate",
    "estimate_traffic",
    "initialize",
    "recommend",
    "set_leaf_modules",
]
__version__ = "0.1.0"
