"""The build puts one C++ runtime in the process.

torch links the shared libstdc++.so.6. A toolchain with only libstdc++.a (the
lent H200 machine's /opt/gcc g++) copied a private libstdc++ into
libzeroshard.so; with two runtimes in one process the first number written to
a std::ostream (a TORCH_WARN in the NVMe I/O engine's set-up) crashed the
ZeroOptimizer constructor. cmake/shared_libstdcxx.cmake links the shared one
instead: these tests check the built libraries, and the module itself under a
compiler that links libstdc++ statically (a wrapper around this machine's g++).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "zeroshard"
# std::ostream::_M_insert<long>: libstdc++ defines it, code that only uses it
# (every library of ours) must not.
LIBSTDCXX_SYMBOL = "_ZNSo9_M_insertIlEERSoT_"

PROBE_SOURCE = r"""
#include <sstream>
#include <string>
extern "C" const char* probe(long v) {
  static std::string s;
  std::ostringstream o;
  o << "v=" << v;
  s = o.str();
  return s.c_str();
}
"""

STATIC_ONLY_GXX = """#!/bin/sh
# A g++ that has no libstdc++.so: it links libstdc++.a into what it links,
# and knows no libstdc++.so.6 either (the module then searches for one).
for a in "$@"; do
  case "$a" in
    -print-file-name=libstdc++.so*) echo "${{a#-print-file-name=}}"; exit 0;;
    -c|-E|-S|-M|-MM) exec {gxx} "$@";;
  esac
done
exec {gxx} "$@" -static-libstdc++
"""


def defined_dynamic_symbols(library: Path) -> set[str]:
    nm = shutil.which("nm")
    assert nm is not None, "nm (binutils) is needed to inspect the built libraries"
    out = subprocess.run(
        [nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True
    ).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def built_libraries() -> list[Path]:
    libraries = sorted(PACKAGE.glob("libzeroshard*.so")) + sorted(PACKAGE.glob("_C*.so"))
    assert libraries, f"no built library under {PACKAGE}: build first (scripts/build.sh)"
    return libraries


def test_built_libraries_use_the_shared_libstdcxx() -> None:
    for library in built_libraries():
        assert LIBSTDCXX_SYMBOL not in defined_dynamic_symbols(library), (
            f"{library.name} carries its own copy of libstdc++: a second C++ runtime beside "
            "torch's (see cmake/shared_libstdcxx.cmake)"
        )


def build_probe(tmp_path: Path, with_module: bool) -> Path:
    gxx = shutil.which("g++")
    cmake = shutil.which("cmake")
    if gxx is None or cmake is None:
        pytest.fail("g++ and cmake are needed to build the probe (scripts/build.sh installs them)")
    wrapper = tmp_path / "static_only_gxx"
    wrapper.write_text(STATIC_ONLY_GXX.format(gxx=gxx))
    wrapper.chmod(0o755)
    project = tmp_path / ("with" if with_module else "without")
    project.mkdir()
    (project / "probe.cpp").write_text(PROBE_SOURCE)
    include = f"include({ROOT / 'cmake' / 'shared_libstdcxx.cmake'})\n" if with_module else ""
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(probe CXX)\n"
        + include
        + "add_library(probe SHARED probe.cpp)\n"
    )
    build = project / "build"
    env = {**os.environ, "CXX": str(wrapper)}
    env.pop("CXXFLAGS", None)
    # Ninja where there is one (scripts/ensure_env.sh installs it; make may
    # be missing on a fresh machine).
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    for command in (
        [cmake, "-S", str(project), "-B", str(build), *generator],
        [cmake, "--build", str(build)],
    ):
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    return build / "libprobe.so"


def probe_output(library: Path) -> str:
    # A fresh interpreter that loads torch first, as every zeroshard run does.
    code = (
        "import ctypes, sys, torch\n"
        f"lib = ctypes.CDLL({str(library)!r})\n"
        "lib.probe.restype = ctypes.c_char_p\n"
        "sys.stdout.write(lib.probe(42).decode())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return f"rc={done.returncode} out={done.stdout!r}"


def test_static_only_compiler_links_the_shared_libstdcxx(tmp_path: Path) -> None:
    # Without the module the wrapper really does copy libstdc++ in, and the
    # number goes missing or the process crashes (H200: SIGSEGV): the test
    # can tell the two builds apart.
    without = build_probe(tmp_path, with_module=False)
    assert LIBSTDCXX_SYMBOL in defined_dynamic_symbols(without)
    assert probe_output(without) != "rc=0 out='v=42'"

    with_module = build_probe(tmp_path, with_module=True)
    assert LIBSTDCXX_SYMBOL not in defined_dynamic_symbols(with_module)
    assert probe_output(with_module) == "rc=0 out='v=42'"
    ctypes.CDLL(str(with_module))  # and it loads here too
