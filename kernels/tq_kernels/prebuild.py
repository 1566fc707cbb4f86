"""Compile tq's three CPU libraries ahead of time, for a platform wheel.

`setup.py` calls `build()` while it builds a (non-editable) wheel in an environment that
has torch and a C++ compiler (`make wheel`): the libraries go into the wheel's
`tq_kernels/prebuilt/` with `build.json`, which `cpu_build.prebuilt()` checks at run time
against the running torch and the installed sources. They are linked against torch's
libraries through a relative rpath (torch beside tq in site-packages; torch has loaded
them before any tq library is, in any case) and carry every SIMD variant, chosen at run
time, so one wheel serves AVX-512, AVX2 and plain x86-64 machines.

    python -m tq_kernels.prebuild DEST      compile into DEST (a folder), print build.json
"""

from __future__ import annotations

import json
import platform
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tq_kernels import cpu_build

LIBRARIES = (cpu_build.MAIN, cpu_build.FIT, cpu_build.KV)


def build(dest: Path, cxx: str | None = None) -> dict:
    """Compile every library into `dest` (in parallel: one compiler process each) and write
    `dest/build.json`; raises RuntimeError naming the library that failed."""
    cxx = cxx or cpu_build.compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    dest.mkdir(parents=True, exist_ok=True)

    def one(main: str) -> tuple[str, dict[str, str]]:
        name = f"{Path(main).stem}.so"
        try:
            cpu_build._compile(cxx, dest / name, main, rpath=cpu_build.PREBUILT_RPATH)
        except Exception as e:
            raise RuntimeError(f"prebuilding {main} failed: {e}") from e
        return main, {"file": name, "sources": cpu_build.source_key(main)}

    with ThreadPoolExecutor(len(LIBRARIES)) as pool:
        libraries = dict(pool.map(one, LIBRARIES))
    info = {"torch": cpu_build.torch_release(), "cxx11_abi": cpu_build.cxx11_abi(),
            "machine": platform.machine(), "compiler": Path(cxx).name,
            "libraries": libraries}
    (dest / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tq_kernels.prebuild DEST")
    print(json.dumps(build(Path(sys.argv[1])), indent=1))
