"""Build tq's CPU kernel on first use, cache it, and load it into torch.

The C++ source ships inside the package (`tq_kernels/csrc/`). Three libraries are built
from it, each from one translation unit: `tq_cpu.cpp` (TQLinear's forward, with the
per-instruction-set headers), `fit_cpu.cpp` (the quantizer's fit, `fit_*` files) and
`kv_cpu.cpp` (attention on KV-cache codes, `kv_*` files). The first process that needs
one compiles it with the system C++ compiler against the installed torch's headers, into
tq's cache (`$TQ_CACHE/kernels`, default `~/.cache/tq/kernels`), named by a hash of its
sources, the torch version and the compiler, so an upgrade of either builds afresh and
nothing stale is ever loaded. The libraries are independent: a change to (or a failed
build of) one never touches another. A library is written to a temporary name and
renamed into place, so concurrent first uses never see half a file. Each registers torch
operators (`torch.ops.tq_cpu.*`, `torch.ops.tq_fit.*`, `torch.ops.tq_kv.*`) and is
loaded with
`torch.ops.load_library`.

A platform wheel (`make wheel`, `tq_kernels.prebuild`) carries the three libraries
already compiled, in `tq_kernels/prebuilt/`, with `build.json` naming the torch they were
built against and a hash of their sources. `load()` takes a prebuilt library first when
both match the running torch and the installed sources; otherwise (a source install, or
another torch) it compiles as above.

No `-march=native`: the SIMD variants are compiled with per-function target pragmas and
chosen at run time, so a cache shared between machines (or a wheel) never runs an
instruction a CPU lacks. Any failure (no compiler, a compile error, an unwritable cache)
is reported by `load()` as a reason string, never raised: the caller falls back to the
torch reference, and `announce()` says so once per process, with the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
PREBUILT = Path(__file__).parent / "prebuilt"  # only in a platform wheel
PREBUILT_RPATH = "$ORIGIN/../../torch/lib"  # tq_kernels/prebuilt -> site-packages/torch/lib
MAIN = "tq_cpu.cpp"
FIT = "fit_cpu.cpp"  # its own files are named fit_*
KV = "kv_cpu.cpp"  # its own files are named kv_*; shared_* go into all, the rest to MAIN
_OWN = {FIT: "fit_", KV: "kv_"}
FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-DNDEBUG", "-w"]
_lock = threading.Lock()
# The SIMD variants every library has, narrowest first; `capped` and `isa_index` are how
# each library's wrapper applies TQ_CPU_ISA and a test's isa= argument.
ISAS = ("scalar", "avx2", "avx512")
# "portable" is what the scalar variant is: plain x86-64 (or any other machine's) code.
_ALIASES = {"portable": "scalar"}


def capped(best: int, warn: bool = False) -> int:
    """The widest variant to run: `best` (what the CPU has), capped by TQ_CPU_ISA.

    The cap makes this machine run the code a narrower CPU runs (`make test-isa` does so
    for each variant below the widest), so it also turns off what such a CPU lacks beside
    the variant itself: bf16 GEMM products below avx512 (`cpu.native_bf16_gemm`)."""
    want = os.environ.get("TQ_CPU_ISA", "").strip().lower()
    want = _ALIASES.get(want, want)
    if not want:
        return best
    if want not in ISAS:
        if warn:
            import warnings

            warnings.warn(f"tq: TQ_CPU_ISA={want!r} is not one of {', '.join(ISAS)} "
                          "(or portable, the same as scalar); "
                          "ignored", RuntimeWarning, stacklevel=4)
        return best
    return min(best, ISAS.index(want))


def isa_index(isa: str | None, cap: int) -> int:
    """The variant a call runs: `cap` by default, or the named one (tests run each)."""
    if isa is None:
        return cap
    isa = _ALIASES.get(isa, isa)
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
    return ISAS.index(isa)


@dataclass(frozen=True)
class Built:
    """The outcome of `load()`: a loaded library, or why there is none."""

    path: Path | None
    error: str | None = None
    prebuilt: bool = False  # loaded from the wheel's tq_kernels/prebuilt, not compiled here


def cache_dir() -> Path:
    """`$TQ_CACHE/kernels`, else `~/.cache/tq/kernels` (tq's cache, as in tq_cli)."""
    root = os.environ.get("TQ_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "tq") / "kernels"


def compiler() -> str | None:
    """$CXX, else the first of c++, g++, clang++ on PATH."""
    env = os.environ.get("CXX")
    if env:
        return env
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _torch_dirs() -> tuple[list[str], str]:
    root = Path(torch.__file__).parent
    return [str(root / "include"), str(root / "include" / "torch" / "csrc" / "api" / "include")], \
        str(root / "lib")


def _command(cxx: str, src: Path, out: Path, rpath: str | None = None) -> list[str]:
    """The compile command; `rpath` (default: the installed torch's lib folder) is where
    the library looks for torch's own libraries."""
    includes, lib = _torch_dirs()
    return [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi()}", f"-I{CSRC}",
            *(f"-isystem{d}" for d in includes), str(src), "-o", str(out), f"-L{lib}",
            "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{rpath or lib}"]


def cxx11_abi() -> int:
    return int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))


def torch_release() -> str:
    """The running torch's version without its local label (2.13.0+cpu and 2.13.0+cu128
    export the same C++ symbols to an operator library)."""
    return torch.__version__.split("+")[0]


def source_key(main: str = MAIN) -> str:
    """Hash of the sources and flags one library is built from (not of the compiler: a
    prebuilt library is matched against the sources installed beside it)."""
    h = hashlib.sha256()
    for f in _sources(main):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(" ".join(FLAGS).encode())
    return h.hexdigest()[:16]


def _sources(main: str) -> list[Path]:
    """The files library `main` is built from: fit_* for FIT, kv_* for KV, all others for
    MAIN, and shared_* (headers any may include) for each, so a change to one library's
    files never rebuilds another."""
    own = _OWN.get(main)

    def belongs(name: str) -> bool:
        if name.startswith("shared_"):
            return True
        return name.startswith(own) if own else not name.startswith(tuple(_OWN.values()))

    return [f for f in sorted(CSRC.iterdir())
            if f.suffix in (".cpp", ".h", ".inc") and belongs(f.name)]


def build_key(cxx: str, main: str = MAIN) -> str:
    """Hash of everything the library depends on: sources, torch, compiler, flags."""
    h = hashlib.sha256(source_key(main).encode())
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    for part in (torch.__version__, version, cxx, " ".join(FLAGS), platform.machine(),
                 str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", ""))):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _compile(cxx: str, target: Path, main: str = MAIN, rpath: str | None = None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so", dir=target.parent)
    os.close(fd)
    command = _command(cxx, CSRC / main, Path(tmp), rpath)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            log = target.with_suffix(".log")
            log.write_text(" ".join(command) + "\n\n" + proc.stdout + proc.stderr)
            lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
            first = (lines or proc.stderr.strip().splitlines() or ["no output"])[0]
            raise RuntimeError(f"{Path(cxx).name} failed: {first.strip()[:200]} (full log: {log})")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def prebuilt(main: str = MAIN) -> tuple[Path | None, str]:
    """The wheel's prebuilt library for `main` if it fits the running torch and the
    installed sources, else None and why not ("" where the install has none at all)."""
    try:
        info = json.loads((PREBUILT / "build.json").read_text())
        entry = info["libraries"][main]
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"the wheel's prebuilt/build.json is unreadable ({e})"
    built_for = f"torch {info.get('torch')} on {info.get('machine')}"
    if (info.get("torch"), info.get("cxx11_abi"), info.get("machine")) != (
            torch_release(), cxx11_abi(), platform.machine()):
        return None, (f"this tq wheel's kernels were built for {built_for}, not torch "
                      f"{torch_release()} on {platform.machine()}")
    if entry.get("sources") != source_key(main):
        return None, "the prebuilt kernels do not match the installed sources"
    path = PREBUILT / str(entry.get("file"))
    if not path.is_file():
        return None, f"the wheel's prebuilt {path.name} is missing"
    return path, ""


def load(main: str = MAIN) -> Built:
    """Load `main`'s library (MAIN, FIT or KV): the wheel's prebuilt one when it fits, else
    the cached build, compiling it first if needed; never raises."""
    with _lock:
        path, why_not = prebuilt(main)
        if path is not None:
            try:
                torch.ops.load_library(str(path))
                return Built(path, prebuilt=True)
            except Exception as e:  # e.g. a libstdc++ older than the build machine's
                why_not = f"the wheel's prebuilt {path.name} did not load ({e})"
        built = _load_compiled(main)
        if built.error is not None and why_not:
            return Built(None, f"{why_not}, and {built.error}")
        return built


def compiled(main: str, cxx: str) -> Path:
    """`main`'s library in the cache, compiled first if it is not there (not loaded)."""
    target = cache_dir() / f"{Path(main).stem}-{build_key(cxx, main)}.so"
    if not target.exists():
        try:
            _compile(cxx, target, main)
        except OSError:  # an unwritable cache: build for this process only
            target = Path(tempfile.mkdtemp(prefix="tq-kernels-")) / target.name
            _compile(cxx, target, main)
    return target


def _load_compiled(main: str) -> Built:
    cxx = compiler()
    if cxx is None:
        return Built(None, "no C++ compiler found")
    try:
        target = compiled(main, cxx)
        torch.ops.load_library(str(target))
    except Exception as e:  # a failed build must never stop a model from running
        return Built(None, str(e) or type(e).__name__)
    return Built(target)


_announced: set[str] = set()


def announce(what: str, built: Built, consequence: str) -> None:
    """Say once per process, as a RuntimeWarning, that a native library is unavailable,
    why, what runs instead and how to get it; a reason already said (the three libraries
    usually fail for the same one) is not said again."""
    if built.error is None or built.error in _announced:
        return
    _announced.add(built.error)
    import warnings

    warnings.warn(f"tq: {what} unavailable ({built.error}); {consequence}. Fix: install a "
                  "C++ compiler (e.g. `apt install g++`, or set CXX) so tq builds it on "
                  f"first use, or a tq platform wheel built for torch {torch_release()} "
                  "(`make wheel`)", RuntimeWarning, stacklevel=5)
