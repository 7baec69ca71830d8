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
