"""`tq eval --sweep`: convert a source under every combination of settings and evaluate each.

The grid is written as space-separated `key=v1,v2` terms, e.g.
"bits=2,3,4 rotation=none,hadamard,orthogonal codebook=lloyd-max,uniform group-size=64,128".
Keys are convert's option names (the grid is parsed and checked in
tq_cli.evaluation.spec, with SweepSpec). Each combination is converted with the library API
into a scratch folder, evaluated against the source and deleted. With `rtn` on, a plain
round-to-nearest row (no rotation, uniform absmax grid, no refinement, no outliers) is
added for every bits x group size: the floor every method must beat.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tq_cli.conversion.converter import convert
from tq_cli.evaluation.compare import evaluate
from tq_cli.evaluation.spec import EvalSpec, SweepSpec, to_spec
from tq_cli.io.text import Text

OnRow = Callable[[dict[str, Any], int, int], None]
__all__ = ["evaluate_sweep", "run_sweep"]


def evaluate_sweep(source: str, text: Text, spec: SweepSpec,
                   on_row: OnRow | None = None) -> dict[str, Any]:
    """`tq eval --sweep`: every combination of spec.grid (round-to-nearest rows first with
    spec.rtn) converted from `source` and compared with it; {source, grid, rows}."""
    scratch = Path(spec.scratch) if spec.scratch is not None else None
    rows = run_sweep(source, spec.combinations(), text, spec, scratch, on_row)
    return {"source": source, "grid": spec.grid, "rows": rows}


def run_sweep(source: str, combos: list[dict[str, Any]], text: Text, spec: EvalSpec,
              scratch: Path | None = None,
              on_row: OnRow | None = None) -> list[dict[str, Any]]:
    """Convert `source` under each combination into a scratch folder under `scratch`,
    compare it with `source` on `text`, delete it; a row per combination."""
    rows: list[dict[str, Any]] = []
    cache: dict = {}
    base = Path(tempfile.mkdtemp(prefix="tq-sweep-", dir=scratch))
    try:
        for i, combo in enumerate(combos):
            label = combo.get("label", "tq")
            cspec = to_spec({k: v for k, v in combo.items() if k != "label"})
            out = base / f"c{i}"
            t = time.perf_counter()
            res = convert(source, out, cspec.model_copy(update={"device": spec.device}))
            convert_s = time.perf_counter() - t
            ev = evaluate(out, source, text, spec, cache=cache)
            row = {"label": label, "settings": {k: v for k, v in combo.items() if k != "label"},
                   "bits_per_weight": res.bits_per_weight, "mean_rel_error": res.mean_rel_error,
                   "convert_seconds": round(convert_s, 2), "eval_seconds": ev["seconds"],
                   "metrics": ev["metrics"], "eval_settings": ev["settings"]}
            rows.append(row)
            shutil.rmtree(out, ignore_errors=True)
            if on_row:
                on_row(row, i + 1, len(combos))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows
