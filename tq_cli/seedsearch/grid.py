"""`tq search-seed`: choose the rotation seed that quantizes each tensor (or the model) best.

The source articles advise a grid search of the rotation seed over 0..100. Per tensor,
the weight is read once and every seed is scored against it, in two stages:

1. screen: every seed, with a one-pass fit (initial RMS scales, the fixed Lloyd-Max
   codebook, no outliers), about a tenth of the cost of the full fit. On SmolLM2 at 3 bits
   its ranking agrees with the full fit's (Spearman 0.75-0.83 over 24 seeds on three
   projections; the exact best seed ranked 0-2 by the screen).
2. exact: the `finalists` best screened seeds, plus seed 0 as the reference, with exactly
   the fit `tq convert` does, so `tq convert --seeds` reproduces the chosen scores.
   `finalists=None` scores every seed exactly.

Scores: relative reconstruction error in the rotated space (`mse`), or the relative
Hessian-weighted output error tr(dW H dW^T) / tr(W H W^T) from a calibration file
(`calib`), where the exact stage runs the calibrated (GPTQ-style) quantization that
`tq convert --calib` runs. Results are appended to per-rank logs as they come, so a
rerun skips what is done; ranks (local `--jobs` processes or `torchrun`) split the
tensors and rank 0 writes SEEDS.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tq_cli.device import Device, resolve_device
from tq_cli.errors import SeedSearchError
from tq_cli.io.manifest import write_json
from tq_cli.io.safetensors_reader import SourceModel, read_weight
from tq_cli.io.seeds import SEEDS_FORMAT
from tq_cli.planning.plan import TensorPlan
from tq_cli.planning.prepare import plan_source
from tq_cli.quant.choose import CalibOptions, quantize_tensor
from tq_cli.quant.colscale import scale_hessian
from tq_cli.quant.grouped import dequantize_rotated, quantize_rotated, sq_norm
from tq_cli.quant.prepare import column_scales, prepare_weight, with_scales
from tq_cli.quant.rotation import Rotation, make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec, convert_default_col_scale
from tq_cli.seedsearch.distributed import Comm
from tq_cli.version import __version__

REFERENCE_SEED = 0
Objective = Literal["mse", "calib"]


class SearchSpec(BaseModel):
    """What `search` needs besides the source and SEEDS path."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seeds: list[int] = Field(min_length=1)
    objective: Objective = "mse"
    calib: str | None = None
    per: Literal["tensor", "model"] = "tensor"
    quant: QuantSpec = Field(default_factory=QuantSpec)
    rotation: RotationSpec = Field(default_factory=RotationSpec)
    recipe: str | None = None
    finalists: int | None = Field(4, ge=1, description="None: score every seed exactly")
    device: Device = "auto"

    @model_validator(mode="before")
    @classmethod
    def _default_col_scale(cls, data: Any) -> Any:
        """Seeds are searched for the weights a conversion stores: column scales on unless
        the quant spec says otherwise."""
        return convert_default_col_scale(data)


ProgressFn = Callable[[str, int, int], None]  # (what, done, total)


def search_key(source: SourceModel, spec: SearchSpec, calib_sha: str | None) -> dict[str, Any]:
    """What the log's scores depend on; a log made with another key is refused."""
    return {"tq": __version__, "source": source.fingerprint, "objective": spec.objective,
            "calib": calib_sha, "quant": spec.quant.model_dump(),
            "rotation": {"kind": spec.rotation.kind, "block": spec.rotation.block},
            "recipe": spec.recipe, "screen": SCREEN}


# The screen's fit: one assignment with RMS scales and the fixed codebook.
SCREEN = {"scale_iters": 0, "outliers": 0.0}


class SearchLog:
    """Append-only JSON lines per rank under LOGDIR; every rank reads all of them."""

    def __init__(self, folder: Path, key: dict[str, Any], rank: int) -> None:
        self.folder = folder
        self.key_hash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        self.key = key
        self.path = folder / f"rank{rank}.jsonl"
        self.done: dict[tuple[str, int, str], float] = {}
        folder.mkdir(parents=True, exist_ok=True)
        for p in sorted(folder.glob("rank*.jsonl")):
            self._read(p)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if fresh:
            self._line({"header": self.key_hash, "key": key})

    def _read(self, path: Path) -> None:
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            damaged = SeedSearchError(f"{path}: line {i + 1} is damaged; delete the folder "
                                      f"{self.folder} to start the search over")
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                if i == len(lines) - 1:
                    break  # a line cut by a kill: that score is redone
                raise damaged from None
            if not isinstance(rec, dict):
                raise damaged
            if "header" in rec:
                if rec["header"] != self.key_hash:
                    raise SeedSearchError(
                        f"{path}: this search log was made with other settings or another "
                        f"model; delete {self.folder} or choose another -o")
                continue
            try:
                t, s, stage, score = rec["t"], rec["s"], rec["stage"], float(rec["score"])
                if not (isinstance(t, str) and isinstance(s, int) and isinstance(stage, str)
                        and math.isfinite(score)):
                    raise TypeError
            except (KeyError, TypeError, ValueError):
                raise damaged from None
            self.done[(t, s, stage)] = score

    def _line(self, rec: dict[str, Any]) -> None:
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()

    def add(self, tensor: str, seed: int, stage: str, score: float) -> None:
        self.done[(tensor, seed, stage)] = score
        self._line({"t": tensor, "s": seed, "stage": stage, "score": score})

    def close(self) -> None:
        self.file.close()


def log_folder(out: Path) -> Path:
    return out.with_name(out.name + ".log")


def assign(tensors: list[TensorPlan], world: int) -> list[list[TensorPlan]]:
    """Split tensors over ranks: largest first onto the least loaded rank (deterministic)."""
    loads = [0] * world
    parts: list[list[TensorPlan]] = [[] for _ in range(world)]
    for tp in sorted(tensors, key=lambda t: (-t.info.numel, t.info.name)):
        r = loads.index(min(loads))
        parts[r].append(tp)
        loads[r] += tp.info.numel
    return parts


class _Scorer:
    """Scores one tensor's weight under rotation seeds."""

    def __init__(self, tp: TensorPlan, w: torch.Tensor, calib: CalibOptions | None,
                 device: torch.device) -> None:
        assert tp.quant is not None and tp.rotation is not None
        self.tp, self.w, self.device = tp, w, device
        self.quant: QuantSpec = tp.quant
        self.screen_quant = self.quant.model_copy(update=SCREEN)
        has_h = calib is not None and calib.calibration.hessian(tp.info.name) is not None
        self.calib = calib if has_h else None  # no H for this tensor: scored by mse
        # Column scales do not depend on the seed: computed once, used by every seed.
        self.t = column_scales(w, self.quant)
        self.norm = sq_norm(w)

    def rotation(self, seed: int) -> Rotation:
        assert self.tp.rotation is not None
        rs = RotationSpec(kind=self.tp.rotation.kind, block=self.tp.rotation.block, seed=seed)
        return make_rotation(rs, self.w.shape[1], self.tp.block)

    def score(self, seed: int, stage: str) -> float:
        rot = self.rotation(seed)
        p = prepare_weight(self.w, self.quant, rot, col_scale=self.t, norm=self.norm)
        w_rot = p.w_rot
        if stage == "exact":  # exactly what convert (--calib) runs for this tensor
            res = quantize_tensor(self.tp.info.name, p, self.quant, rot, self.device,
                                  self.calib)
            return float(res.record.get("weighted_rel_error", res.q.rel_error))
        q = quantize_rotated(w_rot, self.screen_quant, rot, self.device)
        if self.calib is None:
            return with_scales(q, p).rel_error
        from tq_cli.quant.gptq import relative_weighted_error, rotate_hessian

        h = self.calib.calibration.hessian(self.tp.info.name)
        assert h is not None
        if self.t is not None:  # x' = x t: H' = diag(t) H diag(t)
            h = scale_hessian(h, self.t)
        return relative_weighted_error(w_rot, dequantize_rotated(q), rotate_hessian(h, rot))


def _finalists(screen: dict[int, float], k: int | None, seeds: list[int]) -> list[int]:
    ranked = sorted(seeds, key=lambda s: (screen[s], s))
    chosen = ranked if k is None else ranked[:k]
    return sorted(set(chosen) | {REFERENCE_SEED})


def search(source: str | os.PathLike[str], out: str | os.PathLike[str], spec: SearchSpec,
           progress: ProgressFn | None = None, comm: Comm | None = None) -> dict[str, Any] | None:
    """Run this rank's share of the search; rank 0 writes and returns the SEEDS document."""
    comm = comm or Comm()
    t0 = time.perf_counter()
    planned = plan_source(source, spec.recipe, spec.quant, spec.rotation)
    model, tensors = planned.model, planned.plan.converted
    if spec.rotation.kind == "none":
        raise SeedSearchError("--rotation none has no seed to search; pass --rotation "
                              "hadamard or orthogonal")
    calib = None
    calib_sha = None
    if spec.objective == "calib":
        if spec.calib is None:
            raise SeedSearchError("--objective calib needs --calib CALIB (made by tq calibrate)")
        from tq_cli.io.calibration import read_calibration

        calibration = read_calibration(spec.calib)
        calibration.check_source(model)
        calib = CalibOptions(calibration)
        calib_sha = calibration.sha256
    device = resolve_device(spec.device)
    out = Path(out).expanduser()
    log = SearchLog(log_folder(out), search_key(model, spec, calib_sha), comm.rank)
    mine = assign(tensors, comm.world)[comm.rank]
    exact_per_seed = spec.per == "tensor"
    total = len(mine) * (2 if not exact_per_seed else 1)
    done_count = 0
    try:
        def scorer(tp: TensorPlan) -> _Scorer:
            return _Scorer(tp, read_weight(tp.info), calib, device)

        def run(sc: _Scorer, seeds: list[int], stage: str) -> dict[int, float]:
            name = sc.tp.info.name
            for s in seeds:
                if (name, s, stage) not in log.done:
                    log.add(name, s, stage, sc.score(s, stage))
            return {s: log.done[(name, s, stage)] for s in seeds}

        for tp in mine:
            name = tp.info.name
            screen_done = all((name, s, "screen") in log.done for s in spec.seeds)
            sc: _Scorer | None = None
            if not screen_done or exact_per_seed:
                sc = scorer(tp)
            if not screen_done:
                assert sc is not None
                run(sc, spec.seeds, "screen")
            if exact_per_seed:
                assert sc is not None
                screen = {s: log.done[(name, s, "screen")] for s in spec.seeds}
                run(sc, _finalists(screen, spec.finalists, spec.seeds), "exact")
            done_count += 1
            if progress:
                progress(name, done_count, total)
        if not exact_per_seed:
            totals = _model_screen(tensors, log, spec, comm)
            finalists = _finalists(totals, spec.finalists, spec.seeds)
            for tp in mine:
                run(scorer(tp), finalists, "exact")
                done_count += 1
                if progress:
                    progress(tp.info.name, done_count, total)
        mine_scores = {k: v for k, v in log.done.items() if k[0] in {t.info.name for t in mine}}
    finally:
        log.close()
    gathered = comm.all_gather(mine_scores)
    if comm.rank != 0:
        return None
    scores: dict[tuple[str, int, str], float] = {}
    for part in gathered:
        scores.update(part)
    doc = _document(model, spec, tensors, scores, calib_sha, time.perf_counter() - t0,
                    comm.world)
    write_json(out, doc)
    return doc


def _model_screen(tensors: list[TensorPlan], log: SearchLog, spec: SearchSpec,
                  comm: Comm) -> dict[int, float]:
    """Every rank's screen scores combined: numel-weighted mean per seed."""
    names = {tp.info.name: tp.info.numel for tp in tensors}
    local = {k: v for k, v in log.done.items() if k[2] == "screen" and k[0] in names}
    merged: dict[tuple[str, int, str], float] = {}
    for part in comm.all_gather(local):
        merged.update(part)
    total = sum(names.values())
    return {s: sum(merged[(n, s, "screen")] * numel for n, numel in names.items()) / total
            for s in spec.seeds}


def _spread(values: list[float]) -> dict[str, float]:
    return {"best": min(values), "median": statistics.median(values), "worst": max(values)}


def _document(model: SourceModel, spec: SearchSpec, tensors: list[TensorPlan],
              scores: dict[tuple[str, int, str], float], calib_sha: str | None,
              seconds: float, world: int) -> dict[str, Any]:
    """The SEEDS JSON: per tensor the chosen seed, its exact score and the spread."""
    exact = {tp.info.name: {s: v for (t, s, st), v in scores.items()
                            if t == tp.info.name and st == "exact"} for tp in tensors}
    if spec.per == "model":
        numel = {tp.info.name: tp.info.numel for tp in tensors}
        total = sum(numel.values())
        common = set.intersection(*(set(e) for e in exact.values())) & set(spec.seeds)
        model_score = {s: sum(exact[n][s] * numel[n] for n in numel) / total for s in common}
        best_model_seed = min(sorted(model_score), key=lambda s: model_score[s])
    out_tensors: dict[str, Any] = {}
    weighted_best = weighted_ref = 0.0
    total_numel = 0
    for tp in tensors:
        name = tp.info.name
        ex = exact[name]
        listed = {s: v for s, v in ex.items() if s in spec.seeds}
        if spec.per == "model":
            seed = best_model_seed
        else:
            seed = min(sorted(listed), key=lambda s: listed[s])
        screen = [scores[(name, s, "screen")] for s in spec.seeds]
        ref = ex[REFERENCE_SEED]
        out_tensors[name] = {
            "seed": seed, "score": ex[seed], "seed0_score": ref,
            "gain_over_seed0": (ref - ex[seed]) / ref if ref > 0 else 0.0,
            "exact": {str(s): v for s, v in sorted(ex.items())},
            "screen": _spread(screen), "numel": tp.info.numel,
        }
        weighted_best += ex[seed] * tp.info.numel
        weighted_ref += ref * tp.info.numel
        total_numel += tp.info.numel
    doc: dict[str, Any] = {
        "tq_seeds": SEEDS_FORMAT, "tq_version": __version__,
        "source": {"name": model.folder.name, "path": str(model.folder),
                   "fingerprint": model.fingerprint},
        "objective": spec.objective, "calib_sha256": calib_sha, "per": spec.per,
        "quant": spec.quant.model_dump(),
        "rotation": {"kind": spec.rotation.kind, "block": spec.rotation.block},
        "recipe": spec.recipe, "seeds_searched": spec.seeds,
        "screen": SCREEN, "finalists": spec.finalists, "reference_seed": REFERENCE_SEED,
        "seconds": round(seconds, 2), "ranks": world,
        "summary": {
            "tensors": len(tensors),
            "weighted_score_best": weighted_best / total_numel,
            "weighted_score_seed0": weighted_ref / total_numel,
            "gain_over_seed0": (weighted_ref - weighted_best) / weighted_ref
            if weighted_ref > 0 else 0.0,
        },
        "tensors": out_tensors,
    }
    if spec.per == "model":
        doc["summary"]["model_seed"] = best_model_seed
    return doc
