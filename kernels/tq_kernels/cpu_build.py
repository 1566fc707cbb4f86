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

No `-march=native`: the SIMD variants are compiled with per-function target pragmas and
chosen at run time, so a cache shared between machines never runs an instruction a CPU
lacks. Any failure (no compiler, a compile error, an unwritable cache) is reported by
`load()` as a reason string, never raised: the caller falls back to the torch reference.
"""

from __future__ import annotations

import hashlib
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


def _command(cxx: str, src: Path, out: Path) -> list[str]:
    includes, lib = _torch_dirs()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{CSRC}",
            *(f"-isystem{d}" for d in includes), str(src), "-o", str(out), f"-L{lib}",
            "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib}"]


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
    h = hashlib.sha256()
    for f in _sources(main):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    for part in (torch.__version__, version, cxx, " ".join(FLAGS), platform.machine(),
                 str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", ""))):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _compile(cxx: str, target: Path, main: str = MAIN) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(_command(cxx, CSRC / main, Path(tmp)), capture_output=True,
                              text=True, timeout=900)
        if proc.returncode != 0:
            log = target.with_suffix(".log")
            log.write_text(" ".join(_command(cxx, CSRC / main, Path(tmp))) + "\n\n"
                           + proc.stdout + proc.stderr)
            lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
            first = (lines or proc.stderr.strip().splitlines() or ["no output"])[0]
            raise RuntimeError(f"{Path(cxx).name} failed: {first.strip()[:200]} (full log: {log})")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(main: str = MAIN) -> Built:
    """Load the cached library built from `main` (MAIN or FIT), compiling it first if
    needed; never raises."""
    with _lock:
        cxx = compiler()
        if cxx is None:
            return Built(None, "no C++ compiler found (install g++ or set CXX)")
        try:
            target = cache_dir() / f"{Path(main).stem}-{build_key(cxx, main)}.so"
            if not target.exists():
                try:
                    _compile(cxx, target, main)
                except OSError:  # an unwritable cache: build for this process only
                    target = Path(tempfile.mkdtemp(prefix="tq-kernels-")) / target.name
                    _compile(cxx, target, main)
            torch.ops.load_library(str(target))
        except Exception as e:  # a failed build must never stop a model from running
            return Built(None, str(e) or type(e).__name__)
        return Built(target)
