"""What `tq eval` is asked to do: one frozen, validated spec per mode.

`CompareSpec` (the default mode: a candidate against its reference, on windows of text),
`KVEvalSpec` (quantized KV caches against the same model's full-precision cache, and
the passkey test, `NeedleSpec`) and `SweepSpec` (convert a grid of settings, compare
each with the source). Their field types do the validation of choices and ranges, and
the --kv-bits items and the sweep grid are parsed here too, so that a bad setting is
refused before a model is loaded. `EvalSpec` is the text and device part the compare
and sweep modes share.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tq_cli.conversion.flags import BY_FLAG, nest
from tq_cli.conversion.spec import ConvertSpec
from tq_cli.device import Device
from tq_cli.errors import TqError, first_error
from tq_cli.evaluation.kv_baselines import supported_bits
from tq_cli.io.images import image_files
from tq_cli.kvcache.spec import KVSpec, SplitPolicy, resolve_bits

Backend = Literal["quanto", "hqq"]  # transformers' QuantizedCache backends (kv_baselines)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EvalSpec(_Frozen):
    """The text a candidate and its reference are compared on, and where they run."""

    context: int = Field(512, ge=2, description="tokens per window (encoders: the longest "
                         "sentence embedded, at most 512)")
    stride: int | None = Field(None, ge=1, description="causal LMs: a sliding window every "
                               "`stride` tokens (None: non-overlapping windows)")
    max_tokens: int | None = Field(8192, ge=0, description="causal LMs: tokens of the text "
                                   "used (None or 0: all)")
    max_sentences: int = Field(128, ge=2, description="encoders: paragraphs embedded")
    device: Device = "auto"

    @field_validator("stride")
    @classmethod
    def _stride_within_context(cls, stride: int | None, info: ValidationInfo) -> int | None:
        context = info.data.get("context")
        if stride is not None and context is not None and stride > context:
            raise ValueError(f"must be at most --context ({context}), got {stride}")
        return stride


class CompareSpec(EvalSpec):
    """The default mode: a candidate against a reference (None: the source named in the
    candidate's manifest); `write_card` records the result in the candidate's card;
    `images`, for an image-text model, a folder of PNG/JPEG files to compare on."""

    reference: str | None = None
    write_card: bool = False
    images: str | None = Field(None, description="image-text models (CLIP, SigLIP): a "
                               "folder of PNG/JPEG files, unlabelled (None: the labelled "
                               "photographs of scikit-image's wheel)")

    @field_validator("images")
    @classmethod
    def _images_to_read(cls, images: str | None) -> str | None:
        if images is not None:
            folder = Path(images)
            if not folder.is_dir():
                raise ValueError(f"{images} is not a folder")
            if not image_files(folder):
                raise ValueError(f"{images} holds no PNG or JPEG file; pass a folder of "
                                 "images")
        return images


class NeedleSpec(_Frozen):
    """Passkey retrieval: prompts of each length, the key at each depth, per seed."""

    lengths: tuple[Annotated[int, Field(ge=1)], ...] = Field((2048, 4096), min_length=1)
    depths: tuple[Annotated[float, Field(ge=0.0, le=1.0)], ...] = Field(
        (0.1, 0.3, 0.5, 0.7, 0.9), min_length=1)
    seeds: tuple[Annotated[int, Field(ge=0)], ...] = Field(
        (0, 1), min_length=1, description="one passkey per seed; a count n means 0..n-1")
    digits: int = Field(5, ge=1, le=18)

    @field_validator("seeds", mode="before")
    @classmethod
    def _count(cls, seeds: Any) -> Any:
        if isinstance(seeds, int) and not isinstance(seeds, bool):
            if seeds < 1:
                raise ValueError(f"must be at least 1 passkey per length and depth, "
                                 f"got {seeds}")
            return tuple(range(seeds))
        return seeds


def kv_item_bits(raw: str, split: SplitPolicy = "kv") -> tuple[float | None, float | None]:
    """(key bits, value bits) of one --kv-bits item: average bits under `split` ("3.5"),
    or the bits of the streams it names ("k4", "v3", "k4v3"; a stream not named: None,
    full precision). ValueError says what is wrong."""
    m = re.fullmatch(r"(?:k([\d.]+))?(?:v([\d.]+))?", raw)
    named = m is not None and bool(m.group(1) or m.group(2))
    try:
        if m is not None and named:
            return (float(m.group(1)) if m.group(1) else None,
                    float(m.group(2)) if m.group(2) else None)
        average = float(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not bits (4, 3.5), k<bits>, v<bits> or "
                         "k<bits>v<bits>") from None
    try:
        return resolve_bits(average, split)
    except ValueError as e:
        raise ValueError(f"{raw}: {e}") from None


def kv_item_spec(raw: str, split: SplitPolicy = "kv", cache: KVSpec | None = None) -> KVSpec:
    """The cache one --kv-bits item measures: `cache` (the options every item shares)
    with the item's key and value bits. ValueError says what is wrong."""
    key_bits, value_bits = kv_item_bits(raw, split)
    try:
        return KVSpec.model_validate((cache or KVSpec()).model_dump()
                                     | {"key_bits": key_bits, "value_bits": value_bits})
    except ValidationError as e:
        raise ValueError(f"{raw}: {first_error(e)[1]}") from None


def whole_bits(raw: str) -> int | None:
    """An item's bits when it is a whole average ("4"), the widths --kv-compare runs."""
    try:
        bits = float(raw)
    except ValueError:
        return None
    return int(bits) if bits == int(bits) else None


class KVEvalSpec(_Frozen):
    """KV cache mode: each --kv-bits item's cache against a full-precision one, on windows
    of `context` tokens (the first `prefill` through the cache in one forward, the rest
    scored in chunks of `chunk` tokens that read it), and/or the passkey test (`needle`).
    With `needle` alone only a full-precision cache is tested and no text is read."""

    context: int = Field(2048, ge=3, description="tokens per window")
    prefill: int | None = Field(None, ge=1, description="tokens of each window prefilled "
                                "(None: half the context)")
    chunk: int = Field(32, ge=1, description="tokens per scoring forward")
    attention: Literal["codes", "decode"] = Field(
        "codes", description="TurboQuant caches: forwards of a few tokens attend on the codes "
        "where the model supports it (tq_cli.kvcache.attend), or every coded token is "
        "decoded first (the reference path)")
    max_tokens: int | None = Field(8192, ge=0, description="tokens of the text used (None "
                                   "or 0: all)")
    device: Device = "auto"
    split: SplitPolicy = Field("kv", description="how a fractional average is split between "
                               "keys and values (tq_cli.kvcache.spec.resolve_bits)")
    cache: KVSpec = Field(default_factory=KVSpec, description="the options every item's cache "
                          "shares (window, sinks, rotation...); its key_bits and value_bits "
                          "are replaced by each item's")
    bits: tuple[str, ...] = Field((), description="the caches to measure: '4', '3.5', 'k4', "
                                  "'v3', 'k4v3'")
    compare: tuple[Backend, ...] = Field((), description="also transformers' QuantizedCache "
                                         "at the whole widths of `bits` it supports")
    needle: NeedleSpec | None = None

    @field_validator("prefill")
    @classmethod
    def _prefill_fits(cls, prefill: int | None, info: ValidationInfo) -> int | None:
        context = info.data.get("context")
        if prefill is not None and context is not None and prefill >= context - 1:
            raise ValueError(f"must be less than the context minus 1 ({context - 1}), "
                             f"got {prefill}")
        return prefill

    @field_validator("bits")
    @classmethod
    def _items_parse(cls, bits: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if "split" in info.data and "cache" in info.data:  # else their own error is first
            for raw in bits:
                kv_item_spec(raw, info.data["split"], info.data["cache"])
        return bits

    @field_validator("compare")
    @classmethod
    def _widths_to_compare(cls, compare: tuple[str, ...],
                           info: ValidationInfo) -> tuple[str, ...]:
        whole = {whole_bits(raw) for raw in info.data.get("bits", ())}
        for backend in compare:
            widths = supported_bits(backend)
            if not whole & set(widths):
                listed = " or ".join(map(str, widths))
                raise ValueError(f"{backend} runs at {listed} bits and no --kv-bits item "
                                 f"is {listed}; add one or drop {backend}")
        return compare

    @model_validator(mode="after")
    def _something_to_measure(self) -> KVEvalSpec:
        if not self.bits and self.needle is None:
            raise ValueError("no cache setting given, e.g. 4,3.5,3 (or the passkey test "
                             "alone)")
        return self


def parse_sweep(text: str) -> list[dict[str, Any]]:
    """The grid's combinations, in order, as {option: value} dicts; TqError names the
    flag. The grid is space-separated `key=v1,v2` terms whose keys are convert's
    quantization option names (tq_cli.conversion.flags)."""
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
    """The ConvertSpec of one combination (TqError when the combination is invalid). The
    head stays as the source has it: a sweep compares the layers' settings."""
    fields = {BY_FLAG[k].field: BY_FLAG[k].parse(v) if isinstance(v, str) else v
              for k, v in combo.items()}
    try:
        return ConvertSpec.model_validate(nest(fields) | {"head_bits": None})
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
            "scale-iters": 0, "outliers": 0.0, "col-scale": "none", "label": "rtn"}
           for b, g in seen]
    return rtn + combos


class SweepSpec(EvalSpec):
    """Sweep mode: convert `source` under every combination of `grid` (e.g. "bits=3,4
    rotation=none,hadamard") and compare each with the source on the EvalSpec's text;
    `rtn` adds a round-to-nearest row per bits x group size; scratch checkpoints go to
    `scratch` (None: the system's temporary folder) and are deleted after each row."""

    grid: str
    rtn: bool = True
    scratch: str | None = None

    @field_validator("grid")
    @classmethod
    def _grid_is_valid(cls, grid: str) -> str:
        try:
            for combo in parse_sweep(grid):
                to_spec(combo)
        except TqError as e:
            raise ValueError(str(e).removeprefix("--sweep: ")) from None
        return grid

    def combinations(self) -> list[dict[str, Any]]:
        """The grid's combinations, after the round-to-nearest rows when `rtn` is on."""
        combos = parse_sweep(self.grid)
        return with_rtn(combos) if self.rtn else combos
