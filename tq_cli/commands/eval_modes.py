"""`tq eval`'s flags -> the spec of the mode they ask for, or a one-line usage error.

Three modes: the quality comparison (the default; CompareSpec), the KV cache (--kv-bits
and/or --needle; KVEvalSpec) and the sweep (--sweep; SweepSpec). Each reads some of the
flags; one given on the command line that the chosen mode would not read is refused by
name (exit 2), never ignored. "needle" is the KV mode with --needle alone: it runs the
passkey test with a full-precision cache only, so it reads no text and no cache options.
"""

from __future__ import annotations

from typing import Any, Literal

import typer
from pydantic import ValidationError

from tq_cli.commands._common import usage, usage_error
from tq_cli.evaluation.spec import CompareSpec, KVEvalSpec, SweepSpec

Mode = Literal["compare", "kv", "needle", "sweep"]
ModeSpec = CompareSpec | KVEvalSpec | SweepSpec

TEXT = ("text", "context", "max_tokens")
COMMON = frozenset({"candidate", "device", "as_json", *TEXT})
KV_CACHE = ("kv_window", "kv_split", "kv_sinks", "kv_center_keys", "kv_rescale",
            "kv_full_layers", "kv_rotation", "kv_sliding", "kv_qjl", "kv_chunk", "kv_compare",
            "kv_attention")
NEEDLE = ("needle_lengths", "needle_seeds")
SWEEP = ("rtn", "scratch")
# The parameters (of tq_cli.commands.eval.main) each mode reads.
READS: dict[Mode, frozenset[str]] = {
    "compare": COMMON | {"reference", "stride", "write_card", "images"},
    "sweep": COMMON | {"sweep", "stride", *SWEEP},
    "kv": COMMON | {"kv_bits", *KV_CACHE},  # and NEEDLE with --needle
    "needle": frozenset({"candidate", "device", "as_json", "needle", *NEEDLE}),
}
# Why a flag of the comparison does not apply in another mode.
WHY: dict[tuple[str, str], str] = {
    ("reference", "kv"): "the KV cache is measured against the same model's full-precision "
                         "cache",
    ("stride", "kv"): "each window is prefilled through the cache, then scored in --kv-chunk "
                      "chunks",
    ("write_card", "kv"): "the card records weight evaluations only",
    ("reference", "sweep"): "each combination is compared with the source it was converted "
                            "from",
    ("write_card", "sweep"): "its checkpoints are scratch, deleted after each row",
    ("images", "kv"): "KV caches are measured on text, not images",
    ("images", "sweep"): "it compares on text, not images",
}
# Spec fields (dotted pydantic locations) whose flag is not --<field-name>.
FIELD_FLAGS = {
    "grid": "--sweep", "bits": "--kv-bits", "split": "--kv-split", "chunk": "--kv-chunk",
    "compare": "--kv-compare", "attention": "--kv-attention", "cache": "--kv-bits",
    "cache.window": "--kv-window",
    "cache.sinks": "--kv-sinks", "cache.center_keys": "--kv-center-keys",
    "cache.rescale": "--kv-rescale", "cache.full_precision_layers": "--kv-full-layers",
    "cache.rotation": "--kv-rotation", "cache.sliding": "--kv-sliding",
    "cache.qjl": "--kv-qjl", "needle": "--needle", "needle.lengths": "--needle-lengths",
    "needle.seeds": "--needle-seeds", "": "--kv-bits",  # KVEvalSpec's own check
}


def given_flag(ctx: typer.Context, name: str) -> str:
    """The flag as given: --no-rtn for rtn=False, --reference for reference."""
    param = next(p for p in ctx.command.params if p.name == name)
    secondary = getattr(param, "secondary_opts", None)
    if ctx.params.get(name) is False and secondary:
        return str(secondary[0])
    return str(param.opts[0])


def given(ctx: typer.Context) -> list[str]:
    """The parameters set on the command line (or the environment), in declared order.
    (Compared by name: Typer ships its own copy of click's ParameterSource.)"""
    out = []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name) if p.name else None
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            out.append(p.name)
    return out


def choose_mode(params: dict[str, Any]) -> tuple[Mode, str]:
    """The mode and the flag that chose it ("" for the default comparison)."""
    kv_flag = "--kv-bits" if params["kv_bits"] is not None else "--needle"
    kv = params["kv_bits"] is not None or params["needle"]
    if kv and params["sweep"] is not None:
        raise usage(f"--sweep and {kv_flag} are separate modes of tq eval; run them one "
                    "at a time")
    if params["sweep"] is not None:
        return "sweep", "--sweep"
    if kv:
        return ("kv" if params["kv_bits"] is not None else "needle"), kv_flag
    return "compare", ""


def reads(mode: Mode, params: dict[str, Any]) -> frozenset[str]:
    if mode == "kv" and params["needle"]:
        return READS[mode] | {"needle", *NEEDLE}
    return READS[mode]


def why_not(name: str, flag: str, mode: Mode, mode_flag: str) -> str:
    """The usage line refusing `flag` (parameter `name`) in `mode`."""
    if name in KV_CACHE:
        if mode == "needle":
            return (f"{flag} applies only with --kv-bits (--needle alone tests a "
                    "full-precision cache); add --kv-bits or drop it")
        return f"{flag} applies only with --kv-bits; drop it"
    if name in NEEDLE:
        return f"{flag} applies only with --needle; drop it"
    if name in SWEEP:
        return f"{flag} applies only with --sweep; drop it"
    if name in TEXT and mode == "needle":
        return (f"{flag} does not apply with --needle alone (its prompts are generated, "
                "--needle-lengths tokens long); add --kv-bits or drop it")
    why = WHY.get((name, "kv" if mode == "needle" else mode))
    return f"{flag} does not apply with {mode_flag}{f' ({why})' if why else ''}; drop it"


def check_flags(ctx: typer.Context) -> Mode:
    """The mode the flags ask for; a flag it would not read is refused (exit 2)."""
    mode, mode_flag = choose_mode(ctx.params)
    used = reads(mode, ctx.params)
    for name in given(ctx):
        if name not in used:
            raise usage(why_not(name, given_flag(ctx, name), mode, mode_flag))
    return mode


def items(text: str | None, flag: str) -> tuple[str, ...]:
    """'4, 3.5,' -> ('4', '3.5'); an empty item between two others ('4,,3') is refused
    (exit 2) as search-seed refuses '1,,2': a typo, not a request."""
    parts = [x.strip() for x in (text or "").split(",")]
    while parts and not parts[-1]:
        parts.pop()  # a trailing comma
    if any(not x for x in parts):
        raise usage(f"{flag}: an empty item between commas in '{text}'")
    return tuple(parts)


def _text_fields(p: dict[str, Any]) -> dict[str, Any]:
    out = {"max_tokens": p["max_tokens"] or None, "device": p["device"]}
    if p["context"] is not None:  # else the mode's default
        out["context"] = p["context"]
    return out


def _kv_fields(p: dict[str, Any]) -> dict[str, Any]:
    cache = {"window": p["kv_window"], "rotation": p["kv_rotation"],
             "sliding": p["kv_sliding"], "qjl": p["kv_qjl"],
             "full_precision_layers": items(p["kv_full_layers"], "--kv-full-layers")}
    optional = {"sinks": p["kv_sinks"], "center_keys": p["kv_center_keys"],
                "rescale": p["kv_rescale"]}  # None: the cache's default
    cache.update({k: v for k, v in optional.items() if v is not None})
    fields = _text_fields(p) | {"bits": items(p["kv_bits"], "--kv-bits"),
                                "split": p["kv_split"], "chunk": p["kv_chunk"],
                                "compare": items(p["kv_compare"], "--kv-compare"),
                                "attention": p["kv_attention"],
                                "cache": cache}
    if p["needle"]:
        fields["needle"] = {"lengths": items(p["needle_lengths"], "--needle-lengths"),
                            "seeds": p["needle_seeds"]}
    return fields


def build_spec(mode: Mode, p: dict[str, Any]) -> ModeSpec:
    """The mode's spec from the parameters; a validation error is one usage line naming
    the flag (exit 2)."""
    try:
        if mode == "compare":
            return CompareSpec.model_validate(_text_fields(p) | {
                "stride": p["stride"], "reference": p["reference"],
                "write_card": p["write_card"],
                "images": str(p["images"]) if p["images"] is not None else None})
        if mode == "sweep":
            return SweepSpec.model_validate(_text_fields(p) | {
                "stride": p["stride"], "grid": p["sweep"], "rtn": p["rtn"],
                "scratch": str(p["scratch"]) if p["scratch"] is not None else None})
        return KVEvalSpec.model_validate(_kv_fields(p))
    except ValidationError as e:
        raise usage_error(e, FIELD_FLAGS) from None


def spec_from_flags(ctx: typer.Context) -> ModeSpec:
    """Parse flags -> decide the mode -> refuse flags it does not read -> its spec."""
    return build_spec(check_flags(ctx), ctx.params)
