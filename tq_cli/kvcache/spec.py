"""What a TurboQuant KV cache stores: bits for keys and values, the full-precision window
and the layers left alone. Frozen and validated, like the weight specs in `tq_cli.quant.spec`.

Fractional bits: a stream (keys or values) at b = n + f bits stores a fixed set of
round(f * head_dim) channels at n + 1 bits and the rest at n bits (the paper's outlier
channel split, Zandieh et al. 2025, Section 4.3). `resolve_bits` turns one average
`bits` into per-stream bits under either policy: "kv" moves bits from values to keys
(4 -> keys 5, values 3; 3.5 -> keys 4, values 3; keys are the sensitive stream),
"outlier" gives both streams the same fractional bits. Measured on SmolLM2 (see
docs/results.md), "kv" is the default, and at 4 bits K5/V3 beats K4/V4.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from tq_cli.quant.spec import MAX_SEED

KVRotation = Literal["hadamard", "orthogonal"]
SlidingMode = Literal["full", "quantize"]
SplitPolicy = Literal["kv", "outlier"]
Rescale = Literal["none", "norm", "unbiased"]

MIN_BITS, MAX_BITS = 1.0, 8.0
# The "kv" split takes a whole bit off values only down to this: K4/V2 had a slightly
# lower KL than K3/V3 on SmolLM2 but missed 2 of 20 passkeys that K3/V3 found.
MIN_VALUE_BITS = 3.0


def no_bool(value: object) -> object:
    """A pydantic before-validator: True and False are not numbers (a lax int or float
    field takes them as 1 and 0); anything else goes on to the field's own checks, so
    "0" and "-1" from the command line still parse."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {value!r}")
    return value


class KVSpec(BaseModel):
    """How a KV cache quantizes. A stream with bits None stays in full precision."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # strict scalars: True is not 1 bit, 1 sink or seed 1, 0 is not False
    key_bits: StrictFloat | None = Field(4.0, description="bits per key coordinate (None: full)")
    value_bits: StrictFloat | None = Field(3.0, description="bits per value coordinate "
                                           "(None: full)")
    window: StrictInt = Field(128, ge=0, description="most recent tokens kept in full precision")
    sinks: StrictInt = Field(1, ge=0, description="first tokens kept in full precision (the first "
                       "is an attention sink, read by every query)")
    full_precision_layers: tuple[Annotated[int, BeforeValidator(no_bool)], ...] = Field(
        (), description="layer indices (negative counts from the end) kept in full precision")
    sliding: SlidingMode = Field(
        "full", description="sliding-window layers: 'full' keeps their bounded cache in full "
        "precision, 'quantize' quantizes it outside the window as well")
    center: StrictBool = Field(False, description="values: quantize each vector minus a per-head "
                         "mean fixed from the first tokens coded (added back exactly); "
                         "measured worse on SmolLM2, so off")
    center_keys: StrictBool = Field(True, description="keys: quantize each key minus a per-head "
                              "mean taken before RoPE and turned to the key's position "
                              "(`kvcache.rope`); models without a RoPE tq reads code keys "
                              "uncentered")
    rotation: KVRotation = "hadamard"
    rescale: Rescale = Field("norm", description="the stored scale: 'none' the norm (the "
                             "paper), 'norm' so |x_hat| = |x|, 'unbiased' so inner products "
                             "are unbiased")
    qjl: StrictBool = Field(False, description="keys: (b-1)-bit codes plus a 1-bit QJL "
                            "sketch of the residual (the paper's TurboQuant_prod, unbiased "
                            "inner products)")
    seed: StrictInt = Field(0, ge=0, le=MAX_SEED)

    @model_validator(mode="after")
    def _check(self) -> KVSpec:
        for name in ("key_bits", "value_bits"):
            b = getattr(self, name)
            if b is not None and not MIN_BITS <= b <= MAX_BITS:
                raise ValueError(f"{name} must be between 1 and 8, got {b}")
        if self.qjl and self.key_bits is not None and self.key_bits < 2:
            raise ValueError("qjl needs key_bits >= 2 (b-1 bits of codes plus the 1-bit sketch)")
        return self

    @property
    def label(self) -> str:
        def part(b: float | None) -> str:
            return "fp" if b is None else f"{b:g}"

        extra = "+qjl" if self.qjl else ""
        return f"K{part(self.key_bits)}{extra}/V{part(self.value_bits)}"


def resolve_bits(bits: float, split: SplitPolicy = "kv") -> tuple[float, float]:
    """(key_bits, value_bits) averaging `bits` under a split policy.

    "kv": from 4 bits on keys get one bit more than `bits` (at most 8) and values the rest
    (4 -> K5/V3, 4.5 -> K5.5/V3.5, 7.5 -> K8/V7, 8 -> K8/V8); below 4 values get
    floor(bits), at most 3, and keys the rest (3.5 -> K4/V3, 3 -> K3/V3,
    3.25 -> K3.5/V3, 2.5 -> K3/V2, 2 -> K2/V2, 1.5 -> K2/V1). Values never lose bits as
    `bits` grows; keys do once, at 3 (2.75 -> K3.5/V2, 3 -> K3/V3). "outlier" gives both
    streams `bits`.
    """
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be between 1 and 8, got {bits}")
    if split not in ("kv", "outlier"):
        raise ValueError(f"split must be 'kv' or 'outlier', got {split!r}")
    if split == "outlier":
        return bits, bits
    if bits >= MIN_VALUE_BITS + 1:
        key = min(MAX_BITS, bits + 1)
        return key, 2 * bits - key
    value = float(min(math.floor(bits), MIN_VALUE_BITS))
    return 2 * bits - value, value


def split_channels(bits: float, d: int) -> tuple[int, int]:
    """(base bits, channels at base + 1) for a stream of `bits` over head_dim d."""
    base = math.floor(bits)
    high = round((bits - base) * d)
    if base >= MAX_BITS:
        return int(MAX_BITS), 0
    return base, high
