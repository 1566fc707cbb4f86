"""`tq eval --sweep`: convert a source under every combination of settings and evaluate each.

The grid is written as space-separated `key=v1,v2` terms, e.g.
"bits=2,3,4 rotation=none,hadamard,orthogonal codebook=lloyd-max,uniform group-size=64,128".
Keys are convert's option names. Each combination is converted with the library API
into a scratch folder, evaluated against the source and deleted. With `rtn` on, a plain
round-to-nearest row (no rotation, uniform absmax grid, no refinement, no outliers) is
added for every bits x group size: the floor every method must beat.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.conversion.flags import BY_FLAG, nest
from tq_cli.errors import TqError, first_error
from tq_cli.evaluation.compare import EvalSpec, evaluate
from tq_cli.io.text import Text


def parse_sweep(text: str) -> list[dict[str, Any]]:
    """The grid's combinations, in order, as {option: value} dicts."""
    axes: list[tuple[str, list[Any]]] = []
    for term in text.split():
        key, sep, values = term.partition("=")
        if not sep or not values:
            raise TqError(f"--sweep: '{term}' is not key=v1,v2")
        if key not in BY_FLAG:
            raise TqError(f"--sweep: unknown key '{key}'; known: {', '.join(sorted(BY_FLAG))}")
        parse = BY_FLAG[key].parse
        try:
            parsed = [parse(v) for v in values.split(",")]
        except ValueError as e:
            raise TqError(f"--sweep: bad value in '{term}' ({e})") from e
        # temperature stays as typed ('auto', 'none', '2.5'): that is what the table shows.
        axes.append((key, values.split(",") if key == "temperature" else parsed))
    if not axes:
        raise TqError("--sweep: empty grid")
    names = [k for k, _ in axes]
    return [dict(zip(names, combo, strict=True)) for combo in
            itertools.product(*(v for _, v in axes))]


def to_spec(combo: dict[str, Any]) -> ConvertSpec:
    fields = {BY_FLAG[k].field: BY_FLAG[k].parse(v) if isinstance(v, str) else v
              for k, v in combo.items()}
    try:
        return ConvertSpec.model_validate(nest(fields))
    except ValidationError as e:
        _, msg = first_error(e)
        raise TqError(f"--sweep: combination {combo} is invalid: {msg}") from e


def with_rtn(combos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add the round-to-nearest floor once per (bits, group size) of the grid."""
    seen = []
    for c in combos:
        key = (c.get("bits", 4), c.get("group-size", 128))
        if key not in seen:
            seen.append(key)
    rtn = [{"bits": b, "group-size": g, "rotation": "none", "codebook": "uniform",
            "scale-iters": 0, "outliers": 0.0, "label": "rtn"} for b, g in seen]
    return rtn + combos


def run_sweep(source: str, combos: list[dict[str, Any]], text: Text, spec: EvalSpec,
              scratch: Path | None = None,
              on_row: Callable[[dict[str, Any], int, int], None] | None = None
              ) -> list[dict[str, Any]]:
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
