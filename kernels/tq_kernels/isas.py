"""The instruction-set variants of tq's CPU kernels this CPU runs, for `make test-isa` and
for benchmarks that say what they measured on.

`python -m tq_kernels.isas` prints them widest first; `--narrower` leaves out the widest
(the one `make test` already runs). Nothing is printed where the kernel cannot be built:
there is no variant to test then. `describe()` is the record a benchmark writes beside its
numbers.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

from tq_kernels import cpu


def runnable() -> tuple[str, ...]:
    """Every variant this CPU runs, narrowest first; () without the compiled kernel."""
    if not cpu.available():
        return ()
    return cpu.ISAS[:cpu.ISAS.index(cpu.cpu_isa()) + 1]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict[str, Any]:
    """What tq's CPU kernels run here: the variant in use (`cpu_isa`: the CPU's widest, or
    TQ_CPU_ISA's cap), the CPU's widest, whether prefill GEMMs multiply in bf16, and the
    CPU model. None where the kernel is not built (the torch reference runs)."""
    if not cpu.available():
        return {"cpu_isa": None, "cpu_isa_widest": None, "cpu_gemm": None,
                "cpu_model": cpu_model()}
    return {"cpu_isa": cpu.active_isa(), "cpu_isa_widest": cpu.cpu_isa(),
            "cpu_gemm": cpu.gemm_precision(), "cpu_model": cpu_model()}


def main(argv: list[str]) -> int:
    isas = runnable()[::-1]
    if "--narrower" in argv:
        isas = isas[1:]
    print(" ".join(isas))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
