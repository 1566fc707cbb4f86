"""Property-based tests (Hypothesis) of the library API and the readers: for random values
of every parameter, the result is correct or a tq error of one line, never another
exception and never the CLI's `internal error:`. Beside tests/test_fuzz.py's seeded file
mutations; Hypothesis shrinks a failure to its smallest case."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import tq_cli
from tq_cli.app import app
from tq_cli.errors import TqError
from tq_cli.io.safetensors_reader import read_header
from tq_cli.kvcache.cache import make_spec
from tq_cli.quant.grouped import dequantize
from tq_cli.quant.prepare import quantize
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_cli.seedsearch.ranges import parse_seeds

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
ANY = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                st.lists(st.integers(), max_size=3))


def _one_line(e: BaseException) -> None:
    assert isinstance(e, TqError), repr(e)
    assert str(e) and "\n" not in str(e)


@FAST
@given(out=st.integers(1, 40), n=st.integers(1, 300), bits=st.sampled_from([2, 3, 4, 8]),
       group=st.sampled_from([8, 16, 32, 64, 128]), kind=st.sampled_from(
           ["hadamard", "orthogonal", "none"]), cols=st.sampled_from(["none", "sinkhorn"]),
       scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**32 - 1))
def test_quantize_reports_the_error_of_what_it_stores(out: int, n: int, bits: int, group: int,
                                                      kind: str, cols: str, scale: float,
                                                      seed: int) -> None:
    w = torch.randn(out, n, generator=torch.Generator().manual_seed(seed % 1000)) * scale
    q = quantize(w, QuantSpec(bits=bits, group_size=group, col_scale=cols),
                 RotationSpec(kind=kind, seed=seed))
    w_hat = dequantize(q)
    assert w_hat.shape == w.shape and torch.isfinite(w_hat).all()
    measured = float((w_hat - w).double().pow(2).sum() / w.double().pow(2).sum())
    assert q.rel_error == pytest.approx(measured, rel=1e-4, abs=1e-9)
    assert q.rel_error < {2: 0.5, 3: 0.2, 4: 0.08, 8: 0.01}[bits]


@FAST
@given(text=st.text(alphabet="0123456789.,: -x", max_size=24))
def test_seed_lists_parse_or_are_refused(text: str) -> None:
    try:
        seeds = parse_seeds(text)
    except TqError as e:
        _one_line(e)
        return
    assert seeds == sorted(set(seeds)) and 0 < len(seeds) <= 100_000
    assert all(0 <= s <= 2**32 - 1 for s in seeds)


@FAST
@given(bits=ANY, window=ANY)
def test_kv_settings_build_or_are_refused(bits: Any, window: Any) -> None:
    try:
        spec = make_spec(bits, window)
    except TqError as e:
        _one_line(e)
        return
    assert spec.window == window and spec.window >= 0
    if bits is None:
        assert spec.key_bits is None and spec.value_bits is None
    else:
        assert spec.key_bits is not None and spec.value_bits is not None
        assert math.isclose(spec.key_bits + spec.value_bits, 2 * float(bits))


@FAST
@given(device=st.one_of(ANY, st.sampled_from(["tpu", "cuda:x", "cpu:0", "mps", "meta"])),
       dtype=st.one_of(st.none(), st.sampled_from([torch.int8, torch.float64, torch.bool,
                                                   torch.float16])),
       kv_bits=ANY, verify=ANY)
def test_load_arguments_are_refused_by_name(tmp_path: Path, device: Any, dtype: Any,
                                            kv_bits: Any, verify: Any) -> None:
    with pytest.raises(Exception) as e:
        tq_cli.load(tmp_path / "missing", device=device, dtype=dtype, kv_bits=kv_bits,
                    verify_checksums=verify)
    _one_line(e.value)  # an argument refused, or then the missing folder


@FAST
@given(data=st.binary(max_size=200), hlen=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_safetensors_headers_parse_or_are_refused(tmp_path: Path, data: bytes,
                                                  hlen: int | None) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes((struct.pack("<Q", hlen) if hlen is not None else b"") + data)
    try:
        entries, start, raw = read_header(f)
    except TqError as e:
        _one_line(e)
        return
    assert isinstance(entries, dict) and start == 8 + len(raw)


FLAGS = {
    "--bits": st.one_of(st.integers(-3, 10), st.text(max_size=4)),
    "--group-size": st.one_of(st.integers(-8, 300), st.text(max_size=4)),
    "--outliers": st.one_of(st.floats(-1, 1, allow_nan=False), st.text(max_size=4)),
    "--col-scale": st.text(max_size=9),
    "--rotation": st.text(max_size=9),
    "--seed": st.one_of(st.integers(-5, 2**40), st.text(max_size=4)),
    "--target-bits": st.one_of(st.floats(-1, 10, allow_nan=False), st.text(max_size=4)),
    "--synthetic-calib": st.one_of(st.integers(-5, 2**22), st.text(max_size=4)),
    "--shard-size": st.text(max_size=6),
}


@FAST
@given(chosen=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None), max_size=4),
       data=st.data())
def test_convert_flags_never_reach_an_internal_error(tmp_path: Path, chosen: dict,
                                                      data: st.DataObject) -> None:
    args = ["convert", str(tmp_path / "no-such-model"), "-o", str(tmp_path / "out")]
    for flag in chosen:
        args += [flag, str(data.draw(FLAGS[flag]))]
    r = CliRunner().invoke(app, args)
    assert r.exit_code in (1, 2), (args, r.output)
    assert "internal error" not in r.output, (args, r.output)
    assert not (tmp_path / "out").exists()
