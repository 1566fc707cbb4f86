"""What `convert` is asked to do (ConvertSpec) and what it did (ConvertResult)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tq_cli.device import Device
from tq_cli.quant.spec import QuantSpec, RotationSpec, convert_default_col_scale

# Random tokens the default conversion runs through the model (docs/decisions.md: chosen
# from the tokens-quality curve on SmolLM2 and MiniLM), and at 3 bits or fewer, where the
# curve is steeper (SmolLM2 3-bit KL 0.517 with 4096, 0.467 with 8192).
SELF_CALIB_TOKENS = 4096
SELF_CALIB_TOKENS_LOW_BITS = 8192
# Random tokens `--target-bits` measures the Fisher information on (tq_cli.calibration.fisher)
FISHER_TOKENS = 4096
# lm_head's bits where nobody chose (docs/decisions.md: from `tq eval` on SmolLM2).
DEFAULT_HEAD_BITS: Literal[4, 8] | None = 8


class ConvertSpec(BaseModel):
    """Everything `convert` needs besides source and destination."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    quant: QuantSpec = Field(default_factory=QuantSpec)
    rotation: RotationSpec = Field(default_factory=RotationSpec)
    recipe: str | None = None
    device: Device = "auto"
    allow_nonfinite: bool = False
    # Convert a source that is not the complete model its config.json describes (a
    # warning names the first difference) instead of refusing it; for a check that is
    # wrong about a model. A loader still refuses what transformers cannot fill.
    allow_partial: bool = False
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
    # An image-text-to-text model: convert its vision tower too (its language model always).
    vision: bool = False
    synthetic_calib: int | None = Field(
        None, ge=0, le=1 << 20, description="self-calibration: tokens of random vocabulary "
        "run through the model for GPTQ-style error feedback; None = the default "
        "(SELF_CALIB_TOKENS where the model can run, else the weight-only fit with a note), "
        "0 = off")
    self_calib: Literal["random", "sampled"] = Field(
        "random", description="what self-calibration runs the model on: random vocabulary "
        "tokens, or text the model samples itself from a random first token (needs the "
        "whole model in memory once)")
    fast: bool = Field(False, description="the weight-only fit, no self-calibration: "
                       "seconds instead of a minute, lower quality")
    target_bits: float | None = Field(None, gt=1.0, le=8.5, description="mixed precision: "
                                      "average bits per weight to reach")
    bit_choices: tuple[int, ...] | None = Field(
        None, description="the widths --target-bits chooses from; None: 3 and 4 from a "
        "3.5-bit target up where they reach it, else 2, 3 and 4 "
        "(tq_cli.conversion.mixed_precision.default_bit_choices)")
    head_bits: Literal[4, 8] | None = Field(
        DEFAULT_HEAD_BITS, description="store lm_head (and the input embedding tied to it) "
        "quantized at these bits (tq_cli.quant.head); None keeps it as the source has it. "
        "Left at its default, a model whose head tq cannot store keeps it; asked for, such a "
        "model is refused")

    @property
    def head_required(self) -> bool:
        """head_bits was asked for: a model whose head tq cannot store is refused."""
        return "head_bits" in self.model_fields_set and self.head_bits is not None

    @model_validator(mode="before")
    @classmethod
    def _default_col_scale(cls, data: Any) -> Any:
        """Column scales on unless the quant spec says otherwise (CONVERT_COL_SCALE)."""
        return convert_default_col_scale(data)

    @model_validator(mode="after")
    def _check_mixed(self) -> ConvertSpec:
        if self.bit_choices is not None:
            bad = [b for b in self.bit_choices if b not in (2, 3, 4, 8)]
            if bad:
                raise ValueError(f"bit choices must be among 2, 3, 4, 8, got {bad[0]}")
            if not self.bit_choices:
                raise ValueError("bit choices are empty")
        if self.fast and (self.calib is not None or self.synthetic_calib):
            raise ValueError("--fast skips calibration; drop --calib or --synthetic-calib, or "
                             "--fast")
        if self.act_order and self.calib is None and self.self_calib_tokens == 0:
            raise ValueError("act_order needs a calibration (--calib or self-calibration)")
        if self.calib is not None and self.synthetic_calib:
            raise ValueError("--synthetic-calib and --calib are alternatives; pass one of them")
        if self.self_calib == "sampled" and self.self_calib_tokens == 0:
            raise ValueError("--self-calib sampled is a kind of self-calibration; drop --fast, "
                             "--calib or --synthetic-calib 0, or --self-calib")
        if self.synthetic_calib is not None and 0 < self.synthetic_calib < 2:
            raise ValueError("--synthetic-calib needs at least 2 tokens (0 = off)")
        return self

    @property
    def self_calib_tokens(self) -> int:
        """Random tokens self-calibration runs (0: none: --fast, --calib, or turned off)."""
        if self.fast or self.calib is not None or self.synthetic_calib == 0:
            return 0
        if self.synthetic_calib is not None:
            return self.synthetic_calib
        bits = min(self.quant.bits, self.target_bits or self.quant.bits)
        return SELF_CALIB_TOKENS_LOW_BITS if bits <= 3 else SELF_CALIB_TOKENS

    @property
    def self_calib_default(self) -> bool:
        """Self-calibration because nothing was asked: where the model cannot run it, the
        weight-only fit instead (with a note), not an error."""
        return (self.synthetic_calib is None and self.self_calib == "random"
                and self.self_calib_tokens > 0)


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
    # Of `seconds`, the check against the model transformers builds (a fixed cost per
    # architecture, not per byte: tq_cli.planning.prepare).
    check_seconds: float = 0.0
    # Every stored tensor's bytes x 8 over every source weight: the whole model, kept
    # tensors (embeddings, norms, a head in full precision) included.
    model_bits_per_weight: float = 0.0
    head_bits: int | None = None  # lm_head stored quantized at these bits, else None
    # Elements of weight matrices stored quantized: of all of them, and of the
    # non-embedding ones (embedding tables and the head left out; Plan.quantized_share).
    quantized_share: tuple[float, float] = (0.0, 0.0)
    # The behavioural self-check of the finished checkpoint (tq_cli.conversion.selfcheck).
    self_check: dict | None = None

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
            "model_bits_per_weight": round(self.model_bits_per_weight, 6),
            "head_bits": self.head_bits,
            "quantized_share": round(self.quantized_share[0], 6),
            "quantized_share_non_embedding": round(self.quantized_share[1], 6),
            "mean_rel_error": self.mean_rel_error,
            "max_rel_error": self.max_rel_error,
            "seconds": round(self.seconds, 3),
            "check_seconds": round(self.check_seconds, 3),
            "source_bytes": self.source_bytes,
            "output_bytes": self.output_bytes,
            "throughput_mb_s": round(self.source_bytes / 1e6 / max(self.seconds, 1e-9), 2),
            "resumed_tensors": self.resumed_tensors,
            "self_check": self.self_check,
            "device": self.device,
        }
