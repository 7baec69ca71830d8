"""Builds the zeroshard Python package and its C++ extension (zeroshard._C).

Build against the torch already installed (no build isolation), e.g.
``pip install --no-build-isolation -e .`` or ``python setup.py build_ext --inplace``.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def core_sources() -> list[str]:
    """C++ sources of the core plus the bindings; the Gloo factory is C++-only."""
    patterns = [
        "csrc/layout/*.cpp",
        "csrc/comm/communicator.cpp",
        "csrc/comm/rank_health.cpp",
        "csrc/optim/*.cpp",
        "csrc/grads/*.cpp",
        "csrc/params/*.cpp",
        "csrc/config/*.cpp",
        "csrc/precision/*.cpp",
        "csrc/engine/*.cpp",
        "csrc/estimator/*.cpp",
        "csrc/optimizer/*.cpp",
        "csrc/bindings/*.cpp",
    ]
    sources: list[str] = []
    for pattern in patterns:
        sources += sorted(glob.glob(pattern, root_dir=ROOT))
    return sources


setup(
    name="zeroshard",
    version="0.1.0",
    description="ZeRO stages 1-3 as a C++ LibTorch extension with a thin Python layer",
    package_dir={"": "python"},
    packages=["zeroshard"],
    ext_modules=[
        CppExtension(
            name="zeroshard._C",
            sources=core_sources(),
            include_dirs=[os.path.join(ROOT, "csrc", "include")],
            extra_compile_args={"cxx": ["-O2", "-fvisibility=hidden"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
)
