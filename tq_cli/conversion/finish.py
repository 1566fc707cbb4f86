"""The last step of `convert`: manifest, index, config and card, then the swap into place.

Everything here is derived from the plan and the per-tensor records the pipeline
journaled, so a resumed conversion writes the same manifest as an uninterrupted one.
The format of what is written is docs/format.md.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tq_cli.conversion.card import render_card
from tq_cli.conversion.spec import ConvertResult, ConvertSpec
from tq_cli.errors import TqError
from tq_cli.io.format import CONVERTED, MANIFEST
from tq_cli.io.integrity import config_digest, manifest_digest
from tq_cli.io.manifest import quantization_config, write_json
from tq_cli.io.output import PLAN_FILE, copy_other_files, swap_into_place
from tq_cli.io.safetensors_reader import INDEX_NAME
from tq_cli.io.writer import JOURNAL, file_sha256
from tq_cli.planning.plan import Plan
from tq_cli.version import __version__


def finish(plan: Plan, partial: Path, out: Path, done: dict[str, dict], spec: ConvertSpec,
            device: torch.device, seconds: float, resumed: int,
            warnings: list[str], provenance: dict[str, Any],
            check: Callable[[Path], dict[str, Any]] | None = None) -> ConvertResult:
    """Manifest, index, config, copied files and card; `check` of the finished folder
    (tq_cli.conversion.selfcheck), which removes it where it fails; then rename into
    place."""
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
        if tp.module is not None:
            entry["module"] = tp.module
        if tp.expert is not None:
            entry["expert"] = tp.expert.record()
        if tp.head:
            entry["head"] = True
        if tp.embedding is not None:
            entry["embedding"] = tp.embedding
        if tp.note is not None:
            entry["kept_because"] = tp.note
        if tp.action == CONVERTED:
            assert tp.quant is not None and tp.rotation is not None
            share = (rot_bytes[tp.rotation_id] / plan.rotations[tp.rotation_id].users
                     if tp.rotation_id else 0.0)
            nbytes = rec["nbytes"] + share
            bpw = nbytes * 8 / tp.info.numel
            if not tp.head:  # the summary's figures are the layers'; a head has its own
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
                # which fit it got: GPTQ with the calibration Hessians, or weight-only
                "fit": "gptq" if rec.get("calibrated") else "weight-only",
            } | {k: rec[k] for k in ("calibrated", "weighted_rel_error", "fallback")
                 if k in rec})
        else:
            entry["bytes"] = tp.info.nbytes
        if "source_sha256" in rec:
            entry["source_sha256"] = rec["source_sha256"]
        tensors.append(entry)
    output_bytes = sum(plan.layout.shard_size(s) for s in plan.layout.shards)
    head_bits = next((t.quant.bits for t in plan.converted if t.head and t.quant), None)
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
        mixed=provenance.get("mixed_precision"),
        model_bits_per_weight=8 * sum(s.nbytes for s in plan.layout.slots.values())
        / max(1, sum(t.info.numel for t in plan.tensors)),
        head_bits=head_bits, quantized_share=plan.quantized_share())
    files = copy_other_files(plan.source.folder, partial)
    kept_modules = sorted({t.info.name.rsplit(".", 1)[0] for t in plan.tensors
                           if t.action == "keep" and t.info.name.endswith(".weight")})
    # config.json and the manifest record each other's digest (docs/format.md).
    config = dict(plan.source.config or {})
    config["quantization_config"] = quantization_config(
        spec.quant.model_dump(), spec.rotation.model_dump(), spec.rotation.block, kept_modules,
        plan.format_version, head_bits)
    manifest: dict = {
        "format_version": plan.format_version,
        "tq_version": __version__,
        "source": {"path": str(plan.source.folder), "name": plan.source.folder.name,
                   "fingerprint": plan.source.fingerprint, "bytes": plan.source.total_bytes},
        "recipe": plan.recipe.model_dump(exclude_none=True),
        "quant": spec.quant.model_dump(),
        "rotation": spec.rotation.model_dump(),
        "rotations": {rid: {"kind": rp.spec.kind, "n": rp.n, "block": rp.block,
                            "seed": rp.spec.seed, "keys": [k for k, _, _ in rp.keys]}
                      for rid, rp in plan.rotations.items()},
        "summary": {k: v for k, v in result.summary().items()
                    if k not in ("out", "self_check")}
        | {"nonfinite_values": nonfinite_total},
        "tensors": tensors,
        "shards": shard_sha,
        "files": files,
        "guard": plan.guard,
        "config_sha256": config_digest(config),
    } | provenance
    write_json(partial / MANIFEST, manifest)
    index = {"metadata": {"total_size": sum(s.nbytes for s in plan.layout.slots.values()),
                          "format": "tq", "tq_format_version": plan.format_version},
             "weight_map": {k: s.shard for k, s in plan.layout.slots.items()}}
    write_json(partial / INDEX_NAME, index)
    config["quantization_config"]["manifest_sha256"] = manifest_digest(manifest)
    write_json(partial / "config.json", config)
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
    if check is not None:  # the finished folder runs near its original, or goes
        try:
            result.self_check = check(partial)
        except TqError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    swap_into_place(partial, out)
    return result
