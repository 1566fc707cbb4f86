"""Build hooks beside pyproject.toml: a wheel built where torch and a C++ compiler are
importable and on PATH (`make wheel`: pip wheel --no-build-isolation) carries tq's CPU
kernels compiled (`tq_kernels.prebuild`) and is tagged for the platform (py3-none-linux_*:
the libraries use torch's C++ API, not Python's). Anywhere else (an editable install, an
isolated build without torch, TQ_PREBUILD=0) the wheel stays pure Python and the kernels
compile on first use.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent


def _can_prebuild() -> bool:
    if os.environ.get("TQ_PREBUILD", "1").strip().lower() in ("0", "no", "off", "false"):
        return False
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return bool(os.environ.get("CXX") or any(shutil.which(c) for c in ("c++", "g++", "clang++")))


PREBUILD = _can_prebuild()


class PlatformDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # makes bdist_wheel tag the wheel for the platform
        return PREBUILD


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not PREBUILD or getattr(self, "editable_mode", False):
            return
        sys.path.insert(0, str(HERE / "kernels"))
        from tq_kernels import prebuild

        dest = Path(self.build_lib) / "tq_kernels" / "prebuilt"
        info = prebuild.build(dest)
        print(f"tq: prebuilt CPU kernels for torch {info['torch']} in {dest}", file=sys.stderr)


class BdistWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return ("py3", "none", plat) if PREBUILD else super().get_tag()


setup(distclass=PlatformDistribution, cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
