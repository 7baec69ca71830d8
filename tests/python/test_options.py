"""ZeroOptions' scalar options come from one list in the core ([Note: one
list of the scalar options] in zero_options.h): every one of them is a
keyword argument of the Python ZeroOptimizer with the core's default and is
documented in its docstring by the core's description, and the list names
every scalar TORCH_ARG of ZeroOptions."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from zeroshard import _C, ZeroOptimizer

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "include" / "zeroshard" / "zero_options.h"
NONE_MEANS_ZERO = {"max_norm", "gradient_divide_factor"}


def test_every_scalar_option_is_a_keyword_argument_with_the_cores_default() -> None:
    defaults = _C.zero_option_defaults()
    parameters = inspect.signature(ZeroOptimizer.__init__).parameters
    for name, default in defaults.items():
        assert name in parameters, f"ZeroOptimizer has no keyword argument {name!r}"
        given = parameters[name].default
        if name in NONE_MEANS_ZERO:
            assert given is None and default == 0, (name, given, default)
        else:
            assert given == default and type(given) is type(default), (name, given, default)


def test_the_list_names_every_scalar_option_of_the_struct() -> None:
    struct = HEADER.read_text().split("struct ZeroOptions {")[1].split("\n};")[0]
    scalar = set(re.findall(r"TORCH_ARG\((?:int64_t|double|bool), (\w+)\)", struct))
    assert len(scalar) > 10
    assert scalar == set(_C.zero_option_defaults()), scalar ^ set(_C.zero_option_defaults())


def test_the_docstring_documents_every_scalar_option_once_with_the_cores_words() -> None:
    doc = ZeroOptimizer.__doc__ or ""
    flat = " ".join(doc.split())
    for name, description in _C.zero_option_docs().items():
        entries = re.findall(rf"^        {name}: ", doc, flags=re.MULTILINE)
        assert len(entries) == 1, (name, len(entries))
        assert f"{name}: {description}." in flat, name
    assert "_document_scalar_options" not in doc  # the mark was filled in


def test_the_estimators_defaults_are_the_options_defaults() -> None:
    """estimate()'s ZeRO and offload settings default to ZeroOptimizer's own
    (EstimateOptions reads ZeroOptions' and OffloadOptions' defaults), so the
    estimate of a default optimizer follows a changed default."""
    import zeroshard

    zero = _C.zero_option_defaults()
    offload = _C.offload_option_keys()
    expected = {
        "reduce_bucket_size": zero["reduce_bucket_size"],
        "max_buckets_in_flight": zero["max_buckets_in_flight"],
        "prefetch_bucket_size": zero["stage3_prefetch_bucket_size"],
        "max_live_parameters": zero["stage3_max_live_parameters"],
        "reduce_in_fp32": zero["reduce_in_fp32"],
        "sub_group_size": zero["sub_group_size"],
        "offload_ratio": offload["offload_optimizer"]["ratio"],
        "nvme_buffer_count": offload["offload_optimizer"]["buffer_count"],
        "swap_gradients": offload["offload_optimizer"]["swap_gradients"],
        "param_buffer_count": offload["offload_param"]["buffer_count"],
        "param_max_in_cpu": offload["offload_param"]["max_in_cpu"],
    }
    # offload_param's buffer_count is DeepSpeed's 5, not offload_optimizer's 4.
    assert expected["param_buffer_count"] != expected["nvme_buffer_count"]
    defaults = _C.estimate_defaults()
    parameters = inspect.signature(zeroshard.estimate).parameters
    for name, value in expected.items():
        assert defaults[name] == value, (name, defaults[name], value)
        assert parameters[name].default == value, (name, parameters[name].default, value)


def test_the_inner_optimizers_defaults_are_torch_optims() -> None:
    """The one statement of the hyper-parameters' defaults (the core's
    default_inner_options), as the Python layer reads it, is torch.optim's."""
    import torch

    from zeroshard.optimizer_arguments import _DEFAULTS

    assert _DEFAULTS == _C.inner_optimizer_defaults()
    weight = [torch.zeros(1, requires_grad=True)]
    for name, cls in (
        ("adam", torch.optim.Adam),
        ("adamw", torch.optim.AdamW),
        ("sgd", torch.optim.SGD),
    ):
        torch_defaults = cls(weight).defaults
        assert list(_DEFAULTS[name])[0] == "lr"
        for key, value in _DEFAULTS[name].items():
            assert torch_defaults[key] == value, (name, key, torch_defaults[key], value)
