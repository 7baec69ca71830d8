"""Builds the zeroshard Python package and its C++ extension (zeroshard._C).

Build against the torch already installed (no build isolation), e.g.
``pip install --no-build-isolation -e .`` or ``python setup.py build_ext --inplace``;
needs CMake and Ninja (scripts/ensure_env.sh installs both).
"""

import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_DIR = os.path.join(ROOT, "build", "cmake")


class CMakeBuild(build_ext):
    """Builds zeroshard._C with CMakeLists.txt, the one build description.

    The extension holds the bindings only and links the core library, which
    CMake places next to it; scripts/build.sh uses the same build folder, so
    the core compiles once for the C++ tests, the example and Python.
    """

    def build_extension(self, ext: Extension) -> None:
        import torch  # the torch this build is for (no build isolation)

        package_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        os.makedirs(package_dir, exist_ok=True)
        configure = [
            "cmake",
            "-S",
            ROOT,
            "-B",
            BUILD_DIR,
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DZEROSHARD_BUILD_PYTHON=ON",
            f"-DZEROSHARD_PYTHON_PACKAGE_DIR={package_dir}",
        ]
        # e.g. RelWithDebInfo for a backtrace with line numbers (gpu_check.sh).
        if os.environ.get("ZEROSHARD_CMAKE_BUILD_TYPE"):
            configure.append(f"-DCMAKE_BUILD_TYPE={os.environ['ZEROSHARD_CMAKE_BUILD_TYPE']}")
        if not os.path.exists(os.path.join(BUILD_DIR, "CMakeCache.txt")):
            # A first build for Python alone: no GoogleTest needed.
            configure += [
                "-G",
                "Ninja",
                "-DZEROSHARD_BUILD_TESTS=OFF",
                "-DZEROSHARD_BUILD_EXAMPLES=OFF",
            ]
        subprocess.check_call(configure)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(
            ["cmake", "--build", BUILD_DIR, "--target", "zeroshard_python", "-j", jobs]
        )

    def copy_extensions_to_source(self) -> None:
        # setuptools copies only the extension into the source tree (--inplace,
        # editable installs); the core library it links through $ORIGIN goes
        # beside it.
        super().copy_extensions_to_source()
        built = os.path.abspath(os.path.join(self.build_lib, "zeroshard"))
        source_dir = os.path.join(ROOT, "python", "zeroshard")
        if built != os.path.abspath(source_dir):
            shutil.copy2(os.path.join(built, "libzeroshard.so"), source_dir)


setup(
    name="zeroshard",
    version="0.1.0",
    description="ZeRO stages 1-3 as a C++ LibTorch extension with a thin Python layer",
    package_dir={"": "python"},
    packages=["zeroshard", "zeroshard.integrations", "zeroshard.integrations.lightning"],
    ext_modules=[Extension("zeroshard._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
    # The versions zeroshard.integrations is tested with (tests/python/test_hf_trainer.py,
    # test_accelerate.py, test_lightning.py): transformers 5.25, accelerate 1.15,
    # lightning 2.6.6 (zeroshard.integrations.lightning refuses other minor versions).
    extras_require={
        "hf": ["transformers>=5.0,<6", "accelerate>=1.10,<2", "safetensors"],
        "lightning": ["lightning>=2.6,<2.7"],
    },
)
