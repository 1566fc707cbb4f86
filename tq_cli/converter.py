"""`convert`: a model folder in, a format-v1 TurboQuant checkpoint out.

Orchestrates the reader, the plan, the streaming pipeline and the writer. Output goes
into a hidden partial folder beside OUT and is renamed into place only when complete,
so an interrupted run never leaves a folder that looks finished, an existing OUT is
replaced only after the new one is whole, and `resume` picks up verified tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tq_cli import __version__
from tq_cli.calibrated import CalibOptions
from tq_cli.card import render_card
from tq_cli.errors import OutputError, UnsupportedError
from tq_cli.io.manifest import MANIFEST, quantization_config, write_json
from tq_cli.io.safetensors_reader import (
    INDEX_NAME,
    OTHER_WEIGHT_SUFFIXES,
    SourceModel,
    open_source,
)
from tq_cli.io.source import resolve_source
from tq_cli.io.writer import JOURNAL, Journal, ShardWriter, file_sha256
from tq_cli.pipeline import Finished, stream
from tq_cli.plan import FORMAT_VERSION, Plan, make_plan
from tq_cli.recipe import resolve_recipe
from tq_cli.rotation import ROTATION_PREFIX, Rotation, make_rotation
from tq_cli.spec import QuantSpec, RotationSpec

PLAN_FILE = ".tq-plan.json"
Device = Literal["auto", "cpu", "cuda"]


class ConvertSpec(BaseModel):
    """Everything `convert` needs besides source and destination."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    quant: QuantSpec = Field(default_factory=QuantSpec)
    rotation: RotationSpec = Field(default_factory=RotationSpec)
    recipe: str | None = None
    device: Device = "auto"
    allow_nonfinite: bool = False
    overwrite: bool = False
    resume: bool = False
    max_shard_bytes: int = Field(2 * 1024**3, ge=1)
    seeds: dict[str, int] | None = None
    seeds_file: str | None = Field(None, description="a tq search-seed result: per-tensor "
                                   "rotation seeds (overrides `seeds`)")
    calib: str | None = Field(None, description="a tq calibrate file: GPTQ-style error "
                              "feedback in the rotated space")
    damp: float = Field(0.01, gt=0.0, le=1.0, description="GPTQ damping, a fraction of the "
                        "mean diagonal of H")
    act_order: bool = False
    target_bits: float | None = Field(None, gt=1.0, le=8.5, description="mixed precision: "
                                      "average bits per weight to reach")
    bit_choices: tuple[int, ...] = (2, 3, 4)

    @model_validator(mode="after")
    def _check_mixed(self) -> ConvertSpec:
        bad = [b for b in self.bit_choices if b not in (2, 3, 4, 8)]
        if bad:
            raise ValueError(f"bit choices must be among 2, 3, 4, 8, got {bad[0]}")
        if not self.bit_choices:
            raise ValueError("bit choices are empty")
        if self.act_order and self.calib is None:
            raise ValueError("act_order needs a calibration file (--calib)")
        return self


@dataclass
class ConvertResult:
    """What a conversion did; `summary()` is what the CLI prints and --json emits."""

    out: Path
    tensors_converted: int
    tensors_kept: int
    bits_per_weight: float
    mean_rel_error: float
    max_rel_error: float
    seconds: float
    source_bytes: int
    output_bytes: int
    resumed_tensors: int = 0
    device: str = "cpu"
    warnings: list[str] = field(default_factory=list)
    calibrated_tensors: int | None = None  # with --calib: how many used it (others fell back)
    mixed: dict | None = None  # with --target-bits: the allocation

    def summary(self) -> dict:
        extra: dict = {}
        if self.calibrated_tensors is not None:
            extra["calibrated_tensors"] = self.calibrated_tensors
        if self.mixed is not None:
            extra["mixed_precision"] = self.mixed
        return extra | {
            "out": str(self.out),
            "tensors_converted": self.tensors_converted,
            "tensors_kept": self.tensors_kept,
            "bits_per_weight": round(self.bits_per_weight, 6),
            "mean_rel_error": self.mean_rel_error,
            "max_rel_error": self.max_rel_error,
            "seconds": round(self.seconds, 3),
            "source_bytes": self.source_bytes,
            "output_bytes": self.output_bytes,
            "throughput_mb_s": round(self.source_bytes / 1e6 / max(self.seconds, 1e-9), 2),
            "resumed_tensors": self.resumed_tensors,
            "device": self.device,
        }


def resolve_device(device: Device) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError("--device cuda was asked for, but no CUDA device is available; "
                               "use --device cpu or auto")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def partial_path(out: Path) -> Path:
    return out.parent / f".{out.name}.tq-partial"


ProgressFn = Callable[[Finished, int], None]


def convert(source: str | os.PathLike[str], out: str | os.PathLike[str],
            spec: ConvertSpec | None = None, *,
            on_plan: Callable[[Plan], None] | None = None,
            progress: ProgressFn | None = None,
            log: Callable[[str], None] | None = None) -> ConvertResult:
    """Convert SOURCE (folder or hub id) into a TurboQuant checkpoint at OUT."""
    spec = spec or ConvertSpec()
    t0 = time.perf_counter()
    warnings: list[str] = []

    def warn(msg: str) -> None:
        warnings.append(msg)
        if log:
            log(msg)

    folder = resolve_source(source)
    model = open_source(folder)
    out = Path(out).expanduser()
    _check_output(out, folder, spec.overwrite)
    recipe = resolve_recipe(spec.recipe, model.config)
    seeds, seeds_record = spec.seeds, None
    if spec.seeds_file is not None:
        from tq_cli.seedsearch import read_seeds

        seeds, seeds_record = read_seeds(spec.seeds_file, model, spec.rotation)
    plan = make_plan(model, recipe, spec.quant, spec.rotation, seeds, spec.max_shard_bytes)
    if not plan.converted:
        raise UnsupportedError(
            f"{folder}: no tensor matches a quantize rule of recipe '{recipe.name}'; "
            "pass --recipe with one that fits this model")
    device = resolve_device(spec.device)
    calib = _calibration(spec, model)
    provenance: dict[str, Any] = {"seeds": seeds_record} if seeds_record else {}
    if calib is not None:
        provenance["calibration"] = {
            "file": calib.calibration.path.name, "sha256": calib.calibration.sha256,
            "damp": spec.damp, "act_order": spec.act_order,
            "samples": calib.calibration.meta.get("samples"),
            "seqlen": calib.calibration.meta.get("seqlen"),
            "tokens": calib.calibration.meta.get("tokens")}
    if spec.target_bits is not None:
        from tq_cli.mixed import choose_bits

        if log:
            log(f"--target-bits {spec.target_bits:g}: measuring every tensor at "
                f"{', '.join(map(str, spec.bit_choices))} bits first")
        mixed = choose_bits(plan, spec.target_bits, spec.bit_choices, device, calib)
        plan = make_plan(model, recipe, spec.quant, spec.rotation, seeds, spec.max_shard_bytes,
                         bits=mixed.bits)
        provenance["mixed_precision"] = mixed.record
    plan.extra = {k: v for k, v in provenance.items() if k != "seeds"}
    if on_plan:
        on_plan(plan)

    partial = partial_path(out)
    plan_hash = plan.hash()
    done: dict[str, dict] = {}
    fresh = True
    if partial.exists():
        if spec.resume:
            old = _read_plan_hash(partial)
            if old != plan_hash:
                raise OutputError(
                    f"{partial}: an unfinished conversion made with other settings or another "
                    "source; rerun without --resume to start over")
            fresh = False
        else:
            warn(f"removing an unfinished conversion at {partial} (pass --resume to continue it)")
            shutil.rmtree(partial)
    elif spec.resume:
        warn(f"nothing to resume at {partial}; starting from the beginning")
    if fresh:
        try:
            partial.mkdir(parents=True)
        except OSError as e:
            raise OutputError(f"{partial}: cannot create the output folder ({e.strerror}); "
                              "choose another OUT") from e
        write_json(partial / PLAN_FILE, {"plan_hash": plan_hash, "tq_version": __version__})

    writer = ShardWriter(partial, plan.layout)
    journal = Journal(partial)
    try:
        writer.open(create=True)  # on resume: headers and sizes rewritten, data kept
    except OSError as e:
        raise OutputError(f"{e.filename or partial}: cannot write ({e.strerror})") from e
    try:
        if not fresh:
            done = _verified(journal, writer)
            journal.rewrite(list(done.values()))  # drop unverified and cut lines
        rotations = _write_rotations(plan, writer, journal, done)
        todo = [t for t in plan.tensors if t.info.name not in done]
        for fin in stream(todo, writer, rotations, device, spec.allow_nonfinite, warn, calib):
            entry = {"tensor": fin.plan.info.name, "digests": fin.digests, "record": fin.record}
            journal.append(entry)
            done[fin.plan.info.name] = entry
            if progress:
                progress(fin, fin.plan.info.nbytes)
    finally:
        writer.close()
    resumed = sum(1 for t in plan.tensors if t.info.name in done) - len(todo)
    result = _finish(plan, partial, out, done, spec, device, time.perf_counter() - t0,
                     max(resumed, 0), warnings, provenance)
    return result


def _calibration(spec: ConvertSpec, model: SourceModel) -> CalibOptions | None:
    if spec.calib is None:
        return None
    from tq_cli.io.calibration import read_calibration

    calibration = read_calibration(spec.calib)
    calibration.check_source(model)
    return CalibOptions(calibration, spec.damp, spec.act_order)


def _check_output(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse an OUT that would lose or corrupt anything the user has."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise OutputError(f"{out}: is inside the source folder {source}; choose another OUT")
    if dst in src.parents:
        raise OutputError(f"{out}: contains the source folder {source}; choose another OUT")
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise OutputError(f"{out}: already exists; pass --overwrite to replace it "
                          "(the old folder is kept until the new one is complete)")
    if out.is_symlink() or not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder; remove it or choose another OUT")
    if any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise OutputError(f"{out}: exists and is not a tq checkpoint; --overwrite only "
                          "replaces a tq checkpoint or an empty folder, so remove it by hand "
                          "or choose another OUT")


def _read_plan_hash(partial: Path) -> str | None:
    try:
        return json.loads((partial / PLAN_FILE).read_text()).get("plan_hash")
    except (OSError, ValueError):
        return None


def _verified(journal: Journal, writer: ShardWriter) -> dict[str, dict]:
    """Journal entries whose bytes on disk still match their recorded digests."""
    ok: dict[str, dict] = {}
    for entry in journal.read():
        digests = entry.get("digests", {})
        if digests and all(k in writer.layout.slots and writer.digest(k) == d
                           for k, d in digests.items()):
            ok[entry["tensor"]] = entry
    return ok


def _write_rotations(plan: Plan, writer: ShardWriter, journal: Journal,
                     done: dict[str, dict]) -> dict[str, Rotation]:
    rotations: dict[str, Rotation] = {}
    for rid, rp in plan.rotations.items():
        rot = make_rotation(rp.spec, rp.n, rp.block)
        rotations[rid] = rot
        name = f"{ROTATION_PREFIX}{rid}"
        if name in done:
            continue
        digests = {key: writer.write(key, t) for key, t in rot.tensors().items()}
        entry = {"tensor": name, "digests": digests, "record": {"action": "rotation"}}
        journal.append(entry)
        done[name] = entry
    return rotations


def _finish(plan: Plan, partial: Path, out: Path, done: dict[str, dict], spec: ConvertSpec,
            device: torch.device, seconds: float, resumed: int,
            warnings: list[str], provenance: dict[str, Any]) -> ConvertResult:
    """Manifest, index, config, copied files and card; then rename into place."""
    shard_sha = {name: file_sha256(partial / name) for name in plan.layout.shards}
    rot_bytes = {rid: sum(plan.layout.slots[k].nbytes for k, _, _ in rp.keys)
                 for rid, rp in plan.rotations.items()}
    tensors = []
    conv_bits = 0.0
    conv_params = 0
    errors = []
    nonfinite_total = 0
    for tp in plan.tensors:
        rec = done[tp.info.name]["record"]
        entry: dict = {"name": tp.info.name, "shape": list(tp.info.shape),
                       "dtype": tp.info.dtype, "action": tp.action,
                       "keys": [k for k, _, _ in tp.keys],
                       "shards": sorted({plan.layout.slots[k].shard for k, _, _ in tp.keys})}
        if tp.action == "quantize":
            assert tp.quant is not None and tp.rotation is not None
            share = (rot_bytes[tp.rotation_id] / plan.rotations[tp.rotation_id].users
                     if tp.rotation_id else 0.0)
            nbytes = rec["nbytes"] + share
            bpw = nbytes * 8 / tp.info.numel
            conv_bits += nbytes * 8
            conv_params += tp.info.numel
            errors.append(rec["rel_error"])
            nonfinite_total += rec.get("nonfinite", 0)
            entry.update({
                "spec": tp.quant.model_dump(),
                "rotation": {"kind": tp.rotation.kind, "block": tp.block,
                             "seed": tp.rotation.seed, "id": tp.rotation_id},
                "bytes": rec["nbytes"], "rotation_bytes_share": share,
                "bits_per_weight": bpw, "rel_error": rec["rel_error"],
                "nonfinite": rec.get("nonfinite", 0),
            } | {k: rec[k] for k in ("calibrated", "weighted_rel_error", "fallback")
                 if k in rec})
        else:
            entry["bytes"] = tp.info.nbytes
        tensors.append(entry)
    output_bytes = sum(plan.layout.shard_size(s) for s in plan.layout.shards)
    result = ConvertResult(
        out=out, tensors_converted=len(plan.converted),
        tensors_kept=len(plan.tensors) - len(plan.converted),
        bits_per_weight=conv_bits / conv_params if conv_params else 0.0,
        mean_rel_error=sum(errors) / len(errors) if errors else 0.0,
        max_rel_error=max(errors) if errors else 0.0,
        seconds=seconds, source_bytes=plan.source.total_bytes, output_bytes=output_bytes,
        resumed_tensors=resumed, device=str(device), warnings=warnings,
        calibrated_tensors=sum(1 for t in tensors if t.get("calibrated"))
        if "calibration" in provenance else None,
        mixed=provenance.get("mixed_precision"))
    kept_modules = sorted({t.info.name.rsplit(".", 1)[0] for t in plan.tensors
                           if t.action == "keep" and t.info.name.endswith(".weight")})
    manifest: dict = {
        "format_version": FORMAT_VERSION,
        "tq_version": __version__,
        "source": {"path": str(plan.source.folder), "name": plan.source.folder.name,
                   "fingerprint": plan.source.fingerprint, "bytes": plan.source.total_bytes},
        "recipe": plan.recipe.model_dump(exclude_none=True),
        "quant": spec.quant.model_dump(),
        "rotation": spec.rotation.model_dump(),
        "rotations": {rid: {"kind": rp.spec.kind, "n": rp.n, "block": rp.block,
                            "seed": rp.spec.seed, "keys": [k for k, _, _ in rp.keys]}
                      for rid, rp in plan.rotations.items()},
        "summary": {k: v for k, v in result.summary().items() if k != "out"}
        | {"nonfinite_values": nonfinite_total},
        "tensors": tensors,
        "shards": shard_sha,
    } | provenance
    write_json(partial / MANIFEST, manifest)
    index = {"metadata": {"total_size": sum(s.nbytes for s in plan.layout.slots.values()),
                          "format": "tq", "tq_format_version": FORMAT_VERSION},
             "weight_map": {k: s.shard for k, s in plan.layout.slots.items()}}
    write_json(partial / INDEX_NAME, index)
    config = dict(plan.source.config or {})
    block = spec.rotation.block
    config["quantization_config"] = quantization_config(
        spec.quant.model_dump(), spec.rotation.model_dump(), block, kept_modules)
    write_json(partial / "config.json", config)
    _copy_other_files(plan.source.folder, partial)
    (partial / "README.md").write_text(render_card(manifest))
    for path in partial.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for name in (PLAN_FILE, JOURNAL):
        (partial / name).unlink(missing_ok=True)
    _swap_into_place(partial, out)
    return result


def _copy_other_files(src: Path, dst: Path) -> None:
    """Tokenizer and other non-weight files, copied; weights and the old card are not."""
    skip = {"config.json", INDEX_NAME, "README.md", MANIFEST}
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        if str(rel) in skip or path.suffix == ".safetensors" or \
                path.name.endswith(OTHER_WEIGHT_SUFFIXES):
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def _swap_into_place(partial: Path, out: Path) -> None:
    """Rename the finished folder to OUT; an old OUT is removed only after that."""
    old = out.parent / f".{out.name}.tq-old"
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        os.rename(out, old)
    os.rename(partial, out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old.exists():
        shutil.rmtree(old)
