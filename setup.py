"""Build of the optional native extension ``tp_kernels._C`` (the CPU shared-memory symmetric heap).

The package metadata lives in pyproject.toml; this file only adds the CMake build of ``_C``.
``TP_KERNELS_BUILD_EXT`` decides whether it is built:

- ``auto`` (default): build it when CMake, pybind11 and a C++ compiler are found; otherwise, or if
  the build fails, install without it and print why (``pip install -v`` shows the message). The
  package works without it; only the CPU path of ``tp_kernels.symmetric_memory`` is then
  unavailable.
- ``1``: build it, and fail the install if that is impossible.
- ``0``: do not build it.

CMake generates Ninja files when ninja is found (the ``ninja`` build requirement, else one on
PATH), and CMake's default generator otherwise. An editable install (``pip install -e .``)
builds in ``build/`` and copies ``_C*.so`` into ``tp_kernels/``, where ``import tp_kernels._C``
finds it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
BUILD_MODES = ("auto", "0", "1")


def _build_mode() -> str:
    mode = os.environ.get("TP_KERNELS_BUILD_EXT", "auto").strip().lower()
    if mode not in BUILD_MODES:
        raise SystemExit(f"TP_KERNELS_BUILD_EXT must be one of {BUILD_MODES}, got {mode!r}")
    return mode


def _tool_from_package(package: str, binary: str) -> str | None:
    """The executable that a pip package (``cmake``, ``ninja``) ships, if it is installed."""
    try:
        module = __import__(package)
    except ImportError:
        return None
    # ninja names its folder BIN_DIR, cmake CMAKE_BIN_DIR.
    bin_dir = getattr(module, "BIN_DIR", None) or getattr(module, "CMAKE_BIN_DIR", None)
    path = Path(bin_dir or "") / binary
    return str(path) if bin_dir and path.is_file() else None


def _find_cmake() -> str | None:
    return _tool_from_package("cmake", "cmake") or shutil.which("cmake")


def _find_ninja() -> str | None:
    return _tool_from_package("ninja", "ninja") or shutil.which("ninja")


def _find_cxx() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx.split()[0])
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _why_not_buildable() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the shared-memory heap needs Linux (POSIX shm), this is {sys.platform}"
    if _find_cxx() is None:
        return "no C++ compiler found (set CXX, or install g++ or clang++)"
    if _find_cmake() is None:
        return "CMake not found (pip install cmake)"
    try:
        import pybind11  # noqa: F401
    except ImportError:
        return "pybind11 not found (pip install pybind11)"
    return None


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """build_ext that runs CMake for :class:`CMakeExtension` and honours TP_KERNELS_BUILD_EXT."""

    def run(self) -> None:
        mode = _build_mode()
        why = "TP_KERNELS_BUILD_EXT=0" if mode == "0" else _why_not_buildable()
        if why is not None:
            if mode == "1":
                raise SystemExit(f"tp_kernels: cannot build the native extension: {why}")
            self._skip(why)
            return
        try:
            super().run()
        except (subprocess.CalledProcessError, OSError) as exc:
            if mode == "1":
                raise
            self._skip(f"the build failed ({exc}); TP_KERNELS_BUILD_EXT=1 shows the error")

    def _skip(self, why: str) -> None:
        print(
            f"tp_kernels: not building the native extension tp_kernels._C: {why}. "
            "tp_kernels works without it, but the CPU path of the symm backend is unavailable.",
            file=sys.stderr,
        )
        # Nothing to copy into the source tree or to list among the outputs.
        self.extensions = []

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        cmake = _find_cmake()
        ninja = _find_ninja()
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        # One build folder per generator: CMake refuses to switch generators in place.
        build_dir = Path(self.build_temp).resolve() / ("cmake-ninja" if ninja else "cmake")
        configure = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            *generator,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        ]
        subprocess.run(configure, check=True)
        jobs = str(os.cpu_count() or 1)
        subprocess.run([cmake, "--build", str(build_dir), "--parallel", jobs], check=True)
        built = Path(self.get_ext_fullpath(ext.name))
        if not built.is_file():
            raise OSError(f"CMake finished but {built} was not produced")


setup(ext_modules=[CMakeExtension("tp_kernels._C")], cmdclass={"build_ext": CMakeBuild})
