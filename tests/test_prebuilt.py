"""The platform wheel's prebuilt CPU libraries (`tq_kernels/prebuilt/`): taken when they
match the running torch and the installed sources, never otherwise, and a missing fast
path said once with the fix. Each case runs in a fresh interpreter (an operator library
registers its namespace once per process). `make wheel-check` builds the real wheel and
runs it with no compiler on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tq_kernels import cpu_build

if cpu_build.compiler() is None:
    pytest.skip("no C++ compiler: the library to stand in for a prebuilt one cannot be built",
                allow_module_level=True)

_PROBE = """
import json, sys, warnings
from pathlib import Path
from tq_kernels import cpu, cpu_build, fit, kv
cpu_build.PREBUILT = Path(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    built = [m._built() for m in (cpu, fit, kv)]
print(json.dumps({"prebuilt": [b.prebuilt for b in built],
                  "paths": [str(b.path) if b.path else None for b in built],
                  "errors": [b.error for b in built],
                  "warnings": [str(w.message) for w in caught]}))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, Path]:
    """The three libraries as this machine compiles them (the cache's), to copy in; not
    loaded here (this process may hold a build of other sources)."""
    cxx = cpu_build.compiler()
    assert cxx is not None
    return {main: cpu_build.compiled(main, cxx)
            for main in (cpu_build.MAIN, cpu_build.FIT, cpu_build.KV)}


def _folder(tmp: Path, compiled: dict[str, Path], **edits: object) -> Path:
    folder = tmp / "prebuilt"
    folder.mkdir()
    libs = {}
    for main, path in compiled.items():
        name = f"{Path(main).stem}.so"
        shutil.copyfile(path, folder / name)
        libs[main] = {"file": name, "sources": cpu_build.source_key(main)}
    info: dict[str, object] = {"torch": cpu_build.torch_release(),
                               "cxx11_abi": cpu_build.cxx11_abi(),
                               "machine": __import__("platform").machine(),
                               "compiler": "c++", "libraries": libs}
    info.update(edits)
    (folder / "build.json").write_text(json.dumps(info))
    return folder


def _probe(folder: Path, tmp: Path, compiler: bool) -> dict:
    env = {**os.environ, "TQ_CACHE": str(tmp / "cache")}
    if not compiler:
        env["CXX"] = str(tmp / "no-such-compiler")
    out = subprocess.run([sys.executable, "-c", _PROBE, str(folder)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_a_matching_prebuilt_library_runs_without_a_compiler(tmp_path: Path,
                                                             compiled: dict[str, Path]) -> None:
    folder = _folder(tmp_path, compiled)
    got = _probe(folder, tmp_path, compiler=False)
    assert got["prebuilt"] == [True, True, True] and got["warnings"] == []
    assert got["paths"] == [str(folder / f"{n}.so") for n in ("tq_cpu", "fit_cpu", "kv_cpu")]
    assert not (tmp_path / "cache").exists()  # nothing compiled


def test_a_prebuilt_library_for_another_torch_is_refused_and_said_once(
        tmp_path: Path, compiled: dict[str, Path]) -> None:
    folder = _folder(tmp_path, compiled, torch="1.0.0")
    got = _probe(folder, tmp_path, compiler=False)
    assert got["paths"] == [None, None, None]
    machine, cxx = os.uname().machine, tmp_path / "no-such-compiler"
    assert got["errors"] == 3 * [
        f"this tq wheel's kernels were built for torch 1.0.0 on {machine}, not torch "
        f"{cpu_build.torch_release()} on {machine}, and [Errno 2] No such file or directory: "
        f"'{cxx}'"]
    # the three libraries fail for the same reason: one warning, with the fix
    assert len(got["warnings"]) == 1
    assert "runs the torch reference" in got["warnings"][0]
    assert f"built for torch {cpu_build.torch_release()}" in got["warnings"][0]


def test_a_prebuilt_library_for_other_sources_is_compiled_afresh(
        tmp_path: Path, compiled: dict[str, Path]) -> None:
    """An install whose sources changed (an edited checkout) compiles, never loads a stale
    prebuilt library."""
    folder = _folder(tmp_path, compiled)
    info = json.loads((folder / "build.json").read_text())
    info["libraries"][cpu_build.MAIN]["sources"] = "0" * 16
    (folder / "build.json").write_text(json.dumps(info))
    shutil.copytree(Path(cpu_build.cache_dir()), tmp_path / "cache" / "kernels")
    got = _probe(folder, tmp_path, compiler=True)
    assert got["prebuilt"] == [False, True, True] and got["warnings"] == []
    assert got["paths"][0].startswith(str(tmp_path / "cache"))


def test_a_checkout_has_no_prebuilt_folder() -> None:
    """The source tree is a source install: `make wheel` builds into build/, not here."""
    assert not cpu_build.PREBUILT.exists()
    assert cpu_build.prebuilt(cpu_build.MAIN) == (None, "")
