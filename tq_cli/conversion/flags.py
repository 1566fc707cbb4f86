"""The quantization options, declared once: flag, spec field, parser, help and default.

`tq convert`, `tq search-seed` and `tq eval --sweep` all take them; the defaults are
those of `QuantSpec` and `RotationSpec`, the help text and parsing are here, and a
validation error on any spec field is named by its flag through `flag_of`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from tq_cli.errors import first_error
from tq_cli.quant.spec import CONVERT_COL_SCALE, QuantSpec, RotationSpec


def parse_temperature(text: str | None) -> float | str | None:
    """'auto', 'none' (or None) or a number."""
    if text is None or text == "none":
        return None
    if text == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"'{text}' is not a number, 'auto' or 'none'") from None


@dataclass(frozen=True)
class QuantOption:
    flag: str  # without the leading dashes: "group-size"
    field: str  # the spec field it sets: "quant.group_size"
    parse: Callable[[str], Any]  # text (a sweep value, a CLI string) -> the field's value
    help: str

    @property
    def default(self) -> Any:
        if self.field == "quant.col_scale":
            return CONVERT_COL_SCALE  # a conversion's default, not QuantSpec's
        model: type[BaseModel] = QuantSpec if self.field.startswith("quant.") else RotationSpec
        return model.model_fields[self.field.split(".", 1)[1]].default


QUANT_OPTIONS: tuple[QuantOption, ...] = (
    QuantOption("bits", "quant.bits", int, "Bits per code: 2, 3, 4 or 8."),
    QuantOption("group-size", "quant.group_size", int, "Input columns per fp16 scale."),
    QuantOption("codebook", "quant.codebook", str, "lloyd-max | uniform."),
    QuantOption("outliers", "quant.outliers", float,
                "Fraction of weights kept exactly (0.001 = 0.1%)."),
    QuantOption("scale-iters", "quant.scale_iters", int,
                "Scale/codebook refinement passes (0 = none)."),
    QuantOption("window-overlap", "quant.window_overlap", int,
                "Columns of each neighbouring group in a group's scale fit (the articles' "
                "overlapping window)."),
    QuantOption("temperature", "quant.temperature", parse_temperature,
                "Soft codebook refinement: a number, 'auto' (sqrt(d)/ln(group)) or 'none'."),
    QuantOption("col-scale", "quant.col_scale", str,
                "Input-column scales before the rotation: sinkhorn (SINQ's normalisation, "
                "stored per weight) | none."),
    QuantOption("rotation", "rotation.kind", str, "hadamard | orthogonal | none."),
    QuantOption("rotation-block", "rotation.block", int,
                "Rotation block size (default: the group size)."),
    QuantOption("seed", "rotation.seed", int, "Seed of the rotation."),
)
BY_FLAG = {o.flag: o for o in QUANT_OPTIONS}
BY_FIELD = {o.field: o for o in QUANT_OPTIONS}


def nest(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"quant.bits": 4, "rotation.kind": "none"} -> {"quant": {...}, "rotation": {...}}."""
    out: dict[str, dict[str, Any]] = {"quant": {}, "rotation": {}}
    for field, value in values.items():
        top, _, name = field.partition(".")
        out[top][name] = value
    return out


def flag_of(loc: tuple[int | str, ...], extra: dict[str, str] | None = None) -> str:
    """The command-line flag that set the field at pydantic location `loc`."""
    parts = [str(x) for x in loc]
    where = ".".join(parts)
    if where in BY_FIELD:
        return "--" + BY_FIELD[where].flag
    names = extra or {}
    for n in range(len(parts), 0, -1):  # the longest named prefix: "cache.window", "cache"
        key = ".".join(parts[:n])
        if key in names:
            return names[key]
    # No location: a check of the whole spec, named by the flag under "" if any.
    return "--" + parts[-1].replace("_", "-") if parts else names.get("", "options")


def usage_message(e: ValidationError, extra: dict[str, str] | None = None) -> str:
    """One line for the first validation error: '--bits: bits must be ...'."""
    _, what = first_error(e)
    return f"{flag_of(tuple(e.errors()[0]['loc']), extra)}: {what}"
