"""Builds the zeroshard Python package and its C++ extension (zeroshard._C).

Build against the torch already installed (no build isolation), e.g.
``pip install --no-build-isolation -e .`` or ``python setup.py build_ext --inplace``.
"""

import glob
import os
import platform
import shlex
import shutil
import subprocess

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths

ROOT = os.path.dirname(os.path.abspath(__file__))
X86 = platform.machine().lower() in ("x86_64", "amd64")
# io_uring for the NVMe tier (Debian's liburing-dev, installed by
# scripts/ensure_env.sh); without it the I/O engine uses its thread pool.
LIBURING = os.path.exists("/usr/include/liburing.h")

# The host optimizer kernel is compiled once per CPU capability, with the
# flags ATen uses for its own variants; the right one is picked at run time
# (csrc/offload/host_optimizer_kernel.cpp). CMakeLists.txt has the same table.
HOST_KERNEL_SOURCE = "csrc/offload/cpu/host_optimizer_kernel_impl.cpp"
HOST_KERNEL_VARIANTS = {"DEFAULT": []}
if X86:
    HOST_KERNEL_VARIANTS["AVX2"] = ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    HOST_KERNEL_VARIANTS["AVX512"] = [
        "-DCPU_CAPABILITY_AVX512",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-mf16c",
    ]


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
        "csrc/offload/*.cpp",
        "csrc/checkpoint/*.cpp",
        "csrc/io/*.cpp",
        "csrc/bindings/*.cpp",
    ]
    sources: list[str] = []
    for pattern in patterns:
        sources += sorted(glob.glob(pattern, root_dir=ROOT))
    return sources


class BuildWithHostKernels(BuildExtension):
    """Compiles the host kernel's per-capability objects, then the extension."""

    def build_extensions(self) -> None:
        out_dir = os.path.join(ROOT, "build", "host_kernels")
        os.makedirs(out_dir, exist_ok=True)
        compiler = shlex.split(os.environ.get("CXX", "g++"))
        if shutil.which("ccache") and "ccache" not in compiler[0]:
            compiler = ["ccache", *compiler]
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        objects = []
        for capability, flags in HOST_KERNEL_VARIANTS.items():
            obj = os.path.join(out_dir, f"host_optimizer_kernel_{capability}.o")
            includes = [f"-I{p}" for p in [os.path.join(ROOT, "csrc", "include"), *include_paths()]]
            command = [
                *compiler,
                "-std=c++17",
                "-O3",
                "-fPIC",
                "-fvisibility=hidden",
                "-fopenmp",  # at::parallel_for is OpenMP in torch's builds
                f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                f"-DCPU_CAPABILITY={capability}",
                *flags,
                *includes,
                "-c",
                os.path.join(ROOT, HOST_KERNEL_SOURCE),
                "-o",
                obj,
            ]
            subprocess.check_call(command)
            objects.append(obj)
        for ext in self.extensions:
            ext.extra_objects = [*ext.extra_objects, *objects]
        super().build_extensions()


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
            define_macros=[
                ("ZEROSHARD_HOST_KERNELS_X86", "1" if X86 else "0"),
                ("ZEROSHARD_WITH_LIBURING", "1" if LIBURING else "0"),
            ],
            libraries=["uring"] if LIBURING else [],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildWithHostKernels.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
)
