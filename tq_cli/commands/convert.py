"""`tq convert`: options -> ConvertSpec -> `tq_cli.convert`, with progress and a table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.progress import TaskID
from rich.table import Table

from tq_cli.commands._common import (
    GPTQ_HEAP_THRESHOLD,
    bound_heap_growth,
    emit_json,
    quant_option,
    quant_values,
    stdout,
    tensor_progress,
    usage_error,
    warning,
)
from tq_cli.conversion.converter import ConvertResult, ConvertSpec, convert
from tq_cli.conversion.pipeline import Finished
from tq_cli.conversion.spec import (
    DEFAULT_HEAD_BITS,
    SELF_CALIB_TOKENS,
    SELF_CALIB_TOKENS_LOW_BITS,
)
from tq_cli.planning.plan import Plan

HELP = "Convert a model folder (or hub id) into a TurboQuant checkpoint."
EPILOG = """Examples:

  tq convert ./SmolLM2-135M -o ./smol-tq4

  tq convert ./SmolLM2-135M -o ./smol-tq3 --bits 3 --group-size 64 --rotation orthogonal

  tq convert org/model -o out --recipe my-recipe.toml --json > summary.json

  torchrun --nproc-per-node 2 -m tq_cli convert ./Llama-3-8B -o ./llama-tq4

Under torchrun the ranks share the calibration tokens and the tensors of each block and
write one checkpoint (across machines: the same command on each through torchrun's
rendezvous, OUT on a file system every rank sees).
"""
# Flags of convert's own fields; the shared quantization flags are named by tq_cli.conversion.flags.
FLAGS = {
    "device": "--device", "max_shard_bytes": "--shard-size", "bit_choices": "--bit-choices",
    "target_bits": "--target-bits", "damp": "--damp", "synthetic_calib": "--synthetic-calib",
    "self_calib": "--self-calib",
    "fast": "--fast", "head_bits": "--head-bits",
    "": "convert options",
    "quant": "quantization options", "rotation": "rotation options",
}
SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?$", re.IGNORECASE)


def _choices(text: str) -> list[int | str]:
    """'3,4' -> [3, 4]; a non-number is passed through for validation to name."""
    return [int(x) if x.strip().isdigit() else x.strip() for x in text.split(",")]


def _head_bits(text: str) -> int | None:
    """--head-bits: '8' -> 8, 'none' -> None; anything else is a usage error."""
    value = text.strip().lower()
    if value not in ("8", "4", "none"):
        raise typer.BadParameter(f"'{text}' is not 8, 4 or none", param_hint="--head-bits")
    return None if value == "none" else int(value)


def parse_size(text: str) -> int:
    m = SIZE.match(text.strip())
    if not m:
        raise typer.BadParameter(f"'{text}' is not a size like 2GB, 500MB or 1048576")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2).upper()]
    if m.group(3) and m.group(3).lower().startswith("i"):
        mult = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def main(
    source: str = typer.Argument(..., help="Model folder, or a Hugging Face hub id (org/name)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output folder for the checkpoint."),
    bits: int = quant_option("bits"),
    group_size: int = quant_option("group-size"),
    rotation: str = quant_option("rotation"),
    rotation_block: int | None = quant_option("rotation-block"),
    seed: int = quant_option("seed"),
    seeds: Path | None = typer.Option(None, "--seeds", help="Per-tensor rotation seeds from "
                                      "tq search-seed (recorded in the manifest)."),
    codebook: str = quant_option("codebook"),
    outliers: float = quant_option("outliers"),
    scale_iters: int = quant_option("scale-iters"),
    window_overlap: int = quant_option("window-overlap"),
    temperature: str | None = quant_option("temperature"),
    col_scale: str = quant_option("col-scale"),
    calib: Path | None = typer.Option(None, "--calib", help="Calibration file from tq "
                                      "calibrate: GPTQ-style error feedback per layer."),
    damp: float = typer.Option(0.01, "--damp", help="With --calib: damping, a fraction of "
                               "the mean diagonal of H."),
    act_order: bool = typer.Option(False, "--act-order", help="With --calib: quantize columns "
                                   "in order of decreasing H diagonal."),
    synthetic_calib: int | None = typer.Option(
        None, "--synthetic-calib", help="Self-calibration: run the model on this many random "
        f"tokens and quantize GPTQ-style with what it saw (the default does, with "
        f"{SELF_CALIB_TOKENS}, {SELF_CALIB_TOKENS_LOW_BITS} at 3 bits or fewer, where the "
        "model can run); 0 = off."),
    self_calib: str = typer.Option("random", "--self-calib", help="What self-calibration "
                                   "runs the model on: random (vocabulary tokens) | sampled "
                                   "(text the model writes from a random first token; a "
                                   "decoder that fits in memory)."),
    fast: bool = typer.Option(False, "--fast", help="The weight-only fit: no "
                              "self-calibration (seconds instead of a minute, lower "
                              "quality)."),
    target_bits: float | None = typer.Option(None, "--target-bits", help="Mixed precision: "
                                             "choose each tensor's bits for this average."),
    bit_choices: str | None = typer.Option(
        None, "--bit-choices", help="With --target-bits: the widths to choose from (default: "
        "3,4 for a target of 3.5 or more, else 2,3,4)."),
    head_bits: str | None = typer.Option(
        None, "--head-bits", help="Store lm_head (and the input embedding tied to it) "
        "quantized: 8 | 4 | none (kept as the source has it). "
        + (f"Default: {DEFAULT_HEAD_BITS} where the model has a head tq can store."
           if DEFAULT_HEAD_BITS else "Default: none.")),
    recipe: str | None = typer.Option(None, "--recipe",
                                      help="Recipe name (llama, bert, generic) or TOML path."),
    vision: bool = typer.Option(False, "--vision", help="An image-text model (LLaVA, Gemma 3, "
                                "...): convert its vision tower too, not only its language "
                                "model; the projector is kept either way."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    shard_size: str = typer.Option("2GB", "--shard-size", help="Largest output shard."),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite",
                                         help="Quantize NaN/Inf values as 0 and clamp values "
                                         "beyond ±65504 instead of failing."),
    allow_partial: bool = typer.Option(False, "--allow-partial",
                                       help="Convert a source that is not the complete model "
                                       "its config.json describes (said in a warning) "
                                       "instead of failing; loaders still refuse what is "
                                       "missing."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace OUT (kept until the new one is complete)."),
    resume: bool = typer.Option(False, "--resume",
                                help="Continue an interrupted conversion into OUT."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
) -> None:
    try:
        spec = ConvertSpec.model_validate(quant_values(locals()) | {
            "recipe": recipe, "device": device, "allow_nonfinite": allow_nonfinite,
            "allow_partial": allow_partial,
            "overwrite": overwrite, "resume": resume, "max_shard_bytes": parse_size(shard_size),
            "seeds_file": str(seeds) if seeds is not None else None,
            "calib": str(calib) if calib is not None else None, "damp": damp,
            "act_order": act_order, "synthetic_calib": synthetic_calib, "fast": fast,
            "self_calib": self_calib,
            "target_bits": target_bits, "vision": vision,
            "bit_choices": None if bit_choices is None else _choices(bit_choices),
        } | ({} if head_bits is None else {"head_bits": _head_bits(head_bits)}))
    except ValueError as e:  # pydantic's ValidationError, or --temperature's parser
        raise (usage_error(e, FLAGS) if isinstance(e, ValidationError)
               else typer.BadParameter(str(e), param_hint="--temperature")) from None

    # The calibration forward and the weight-only fit keep a bounded heap; GPTQ, which
    # allocates and frees large temporaries all the time, gets a loose one (_common.py).
    calibrated = spec.calib is not None or spec.self_calib_tokens > 0
    if spec.calib is None:
        bound_heap_growth()
    from tq_cli.parallel import finish_comm, torchrun_comm

    comm = torchrun_comm()  # under torchrun: this rank (rank 0 reports; all convert)
    rank0 = comm is None or comm.rank == 0
    with tensor_progress(enabled=rank0) as bar:
        tasks: dict[str, TaskID] = {}

        counts = {"done": 0, "total": 0}

        def on_plan(plan: Plan) -> None:
            if calibrated:
                bound_heap_growth(GPTQ_HEAP_THRESHOLD)
            counts["total"] = len(plan.tensors)
            tasks["b"] = bar.add_task(f"tensors 0/{counts['total']}",
                                      total=plan.source.total_bytes)

        def on_done(fin: Finished, nbytes: int) -> None:
            counts["done"] += 1
            bar.update(tasks["b"], advance=nbytes,
                       description=f"tensors {counts['done']}/{counts['total']}")

        def log(msg: str) -> None:
            if rank0:
                warning(bar.console, msg)

        try:
            result = convert(source, out, spec, on_plan=on_plan, progress=on_done, log=log,
                             comm=comm)
        finally:
            finish_comm(comm)
    if not rank0:
        return
    if as_json:
        emit_json(result.summary())
    else:
        stdout.print(summary_table(result, spec))


def _choices_used(summary: dict[str, Any], spec: ConvertSpec) -> list[int]:
    """The widths --target-bits chose from: the manifest's record (a default depends on
    the model), else what was asked."""
    mixed = summary.get("mixed_precision") or {}
    return list(mixed.get("choices") or spec.bit_choices or ())


def summary_table(r: ConvertResult, spec: ConvertSpec) -> Table:
    s = r.summary()
    t = Table(title=f"tq convert -> {r.out}", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("settings", (f"{spec.quant.bits}-bit" if spec.target_bits is None else
                      f"mixed {spec.target_bits:g} bits "
                      f"({'/'.join(map(str, _choices_used(s, spec)))})")
         + f", group {spec.quant.group_size}, {spec.quant.codebook}, "
           f"rotation {spec.rotation.kind}"),
        ("tensors converted", str(r.tensors_converted)),
        ("tensors kept", str(r.tensors_kept)),
        ("bits per weight (converted)", f"{r.bits_per_weight:.4f}"),
        ("bits per weight (whole model)", f"{r.model_bits_per_weight:.4f}"),
        ("lm_head", f"{r.head_bits}-bit" if r.head_bits else "not quantized"),
        ("mean rel. reconstruction error", f"{r.mean_rel_error:.6f}"),
        ("max rel. reconstruction error", f"{r.max_rel_error:.6f}"),
        ("source size", f"{r.source_bytes / 1e6:.1f} MB"),
        ("checkpoint size", f"{r.output_bytes / 1e6:.1f} MB"),
        ("time", f"{r.seconds:.1f} s"),
        ("throughput", f"{s['throughput_mb_s']:.1f} MB/s"),
        ("device", r.device),
    ]
    if r.calibrated_tensors is not None:
        rows.append(("calibrated (GPTQ) tensors", f"{r.calibrated_tensors} of "
                                                  f"{r.tensors_converted}"))
    if r.mixed is not None:
        per = ", ".join(f"{b}-bit: {n}" for b, n in r.mixed["tensors_per_bits"].items())
        rows.append(("tensors per width", per))
    if r.resumed_tensors:
        rows.append(("resumed (already done)", str(r.resumed_tensors)))
    for k, v in rows:
        t.add_row(k, v)
    return t
