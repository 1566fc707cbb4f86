"""Typed, frozen specifications passed into the library (never CLI namespaces).

`QuantSpec` says how one tensor is quantized, `RotationSpec` how its input dimension is
rotated first. Both are validated on construction and written into the manifest.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RotationKind = Literal["hadamard", "orthogonal", "none"]
CodebookKind = Literal["lloyd-max", "uniform"]
ColScaleKind = Literal["sinkhorn", "none"]
# What a conversion uses where nobody chose (QuantSpec's own default stays "none", so a
# spec read from an older manifest, or built in code for one tensor, means no scales).
CONVERT_COL_SCALE: ColScaleKind = "sinkhorn"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class QuantSpec(_Frozen):
    """How to quantize one weight [out, in] in the rotated space (docs/design.md, math 2-6)."""

    bits: int = Field(4, description="code bits: 2, 3, 4 or 8")
    group_size: int = Field(128, ge=8, description="input columns per fp16 scale")
    codebook: CodebookKind = "lloyd-max"
    outliers: float = Field(0.001, ge=0.0, le=0.05, description="fraction kept exactly")
    scale_iters: int = Field(
        4, ge=0, le=50,
        description="alternating scale (least squares) / codebook refinements; 0 keeps the "
        "initial RMS (lloyd-max) or absmax (uniform) scales and the fixed codebook",
    )
    window_overlap: int = Field(
        0, ge=0,
        description="columns from each neighbouring group that also enter a group's scale "
        "fit (the articles' overlapping window); 0 = off",
    )
    temperature: float | Literal["auto"] | None = Field(
        None,
        description="soft codebook refinement: responsibilities exp(-T^2 (z-c)^2 / 2) in "
        "units of the group scale; 'auto' = the articles' sqrt(in_features)/ln(group_size); "
        "None = hard k-means",
    )

    col_scale: ColScaleKind = Field(
        "none",
        description="input-column scales before the rotation (SINQ's Sinkhorn "
        "normalisation, tq_cli.quant.colscale), stored per weight; 'none' = off. A "
        "conversion's default is 'sinkhorn' (tq_cli.conversion.spec)",
    )

    @model_validator(mode="after")
    def _check(self) -> QuantSpec:
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"bits must be 2, 3, 4 or 8, got {self.bits}")
        if self.group_size % 8:
            raise ValueError(f"group_size must be a multiple of 8, got {self.group_size}")
        if self.window_overlap >= self.group_size:
            raise ValueError("window_overlap must be smaller than group_size")
        if isinstance(self.temperature, float) and self.temperature <= 0:
            raise ValueError("temperature must be positive")
        if self.temperature is not None and self.bits > 4:
            raise ValueError("temperature (soft codebook refinement) needs bits <= 4")
        return self


def convert_default_col_scale(data: object) -> object:
    """A conversion's (or seed search's) spec data with `quant.col_scale` set to
    CONVERT_COL_SCALE where nobody chose one (a pydantic before-validator's body)."""
    if not isinstance(data, dict):
        return data
    quant = data.get("quant")
    if quant is None:
        quant = QuantSpec(col_scale=CONVERT_COL_SCALE)
    elif isinstance(quant, dict) and "col_scale" not in quant:
        quant = {**quant, "col_scale": CONVERT_COL_SCALE}
    elif isinstance(quant, QuantSpec) and "col_scale" not in quant.model_fields_set:
        quant = QuantSpec(**{**quant.model_dump(), "col_scale": CONVERT_COL_SCALE})
    return {**data, "quant": quant}


# Seeds are kept to 32 bits: every generator tq draws from takes them without folding
# two seeds into one, and a SEEDS file or a CLI value outside is refused by name.
MAX_SEED = 2**32 - 1


class RotationSpec(_Frozen):
    """The rotation of the input dimension (docs/design.md, math 1); block None: the group size."""

    kind: RotationKind = "hadamard"
    block: int | None = Field(None, ge=1)
    seed: int = Field(0, ge=0, le=MAX_SEED)

    @model_validator(mode="after")
    def _check(self) -> RotationSpec:
        if self.kind == "hadamard" and self.block is not None and self.block & (self.block - 1):
            raise ValueError(f"a Hadamard rotation block must be a power of two, got {self.block}")
        return self

    def resolved_block(self, group_size: int) -> int:
        return self.block if self.block is not None else group_size


def temperature_auto(in_features: int, group_size: int) -> float:
    """The articles' T = sqrt(d) / log(group_size) (docs/design.md, math 6)."""
    import math

    return math.sqrt(in_features) / math.log(group_size)
