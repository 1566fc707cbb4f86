"""Column scales before the rotation (SINQ's Sinkhorn normalisation): the scales, the
error tq reports for them, the calibrated fit, and checkpoints that store them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_loader import _close
from typer.testing import CliRunner

import tq_cli
from tq_cli.app import app
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.io.format import FORMAT_VERSION
from tq_cli.io.integrity import config_digest, manifest_digest
from tq_cli.quant.choose import CalibOptions, fit_weight, quantize_tensor
from tq_cli.quant.colscale import scale_hessian, sinkhorn_columns
from tq_cli.quant.grouped import dequantize
from tq_cli.quant.prepare import prepare_weight, quantize
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_cli.runtime.tq_linear import TQLinear


def _explicit_sinkhorn(w: torch.Tensor, iters: int) -> torch.Tensor:
    """SINQ's normalisation as written: form x, divide rows, then columns, by their
    (population) std; keep the least imbalanced iterate's column scales."""
    x = w.double()
    log_c = torch.zeros(w.shape[1], dtype=torch.float64)
    best, best_c = float("inf"), log_c.clone()
    for _ in range(iters):
        x = x / x.std(dim=1, keepdim=True, correction=0)
        c = x.std(dim=0, keepdim=True, correction=0)
        x = x / c
        log_c += c.log().flatten()
        both = torch.cat([x.std(dim=1, correction=0), x.std(dim=0, correction=0)])
        if float(both.max() / both.min()) < best:
            best, best_c = float(both.max() / both.min()), log_c.clone()
    return (best_c - best_c.mean()).exp()


def _heavy_columns(out: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cols = torch.exp(torch.randn(n, generator=g) * 1.2)  # lognormal column magnitudes
    rows = torch.exp(torch.randn(out, 1, generator=g) * 0.3)
    return torch.randn(out, n, generator=g) * cols * rows


@pytest.mark.parametrize("shape", [(96, 256), (256, 96)])
def test_column_scales_are_sinqs_normalisation(shape: tuple[int, int]) -> None:
    w = _heavy_columns(*shape)
    t = sinkhorn_columns(w, iters=16)
    want = _explicit_sinkhorn(w, 16).float()
    assert t.dtype == torch.float32 and torch.equal(t, t.half().float())  # stored as fp16
    assert torch.allclose(t, want, rtol=2e-3, atol=0), float((t / want - 1).abs().max())


def test_a_lone_large_entry_cannot_push_a_column_past_fp16_scales() -> None:
    w = torch.randn(64, 128) * 1e-3
    w[:, 5] = 1e-9
    w[7, 5] = 1.0  # a quiet column with one large value
    t = sinkhorn_columns(w)
    assert float((w / t).abs().max()) <= 2.0**13


@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
def test_the_reported_error_is_the_stored_weights(kind: str) -> None:
    w = _heavy_columns(128, 384)
    q = quantize(w, QuantSpec(bits=3, group_size=64, col_scale="sinkhorn"),
                 RotationSpec(kind=kind, seed=1))
    assert q.col_scale is not None and q.col_scale.dtype == torch.float16
    measured = float((dequantize(q) - w).double().pow(2).sum() / w.double().pow(2).sum())
    assert q.rel_error == pytest.approx(measured, rel=1e-5)
    plain = quantize(w, QuantSpec(bits=3, group_size=64), RotationSpec(kind=kind, seed=1))
    # (the plain weight error is not what the scales lower: on these random columns it
    # doubles; what they lower is the models' output error, docs/results.md)
    assert q.nbytes() == plain.nbytes() + 2 * w.shape[1]


class _Hessians:
    def __init__(self, h: torch.Tensor) -> None:
        self.h = h

    def hessian(self, tensor_name: str) -> torch.Tensor | None:
        return self.h.clone()  # the caller's own copy, as the protocol says

    def unusable(self, tensor_name: str) -> str | None:
        return None

    def group(self, tensor_name: str) -> str | None:
        return "g"


def test_the_calibrated_fit_minimises_the_original_weighted_error() -> None:
    """With x' = x t and H' = diag(t) H diag(t), tr(dW' H' dW'^T) = tr(dW H dW^T): the
    weighted error GPTQ reports is the original weight's, measured here from scratch."""
    g = torch.Generator().manual_seed(3)
    n = 256
    w = _heavy_columns(64, n, seed=3)
    x = torch.randn(2048, n, generator=g) * torch.exp(torch.randn(n, generator=g))
    h = (x.T.double() @ x.double()) / x.shape[0]
    spec = QuantSpec(bits=3, group_size=64, col_scale="sinkhorn")
    rot = make_rotation(RotationSpec(seed=2), n, 64)
    prepared = prepare_weight(w, spec, rot)
    t = prepared.col_scale
    assert t is not None and torch.equal(t, sinkhorn_columns(w))
    assert torch.equal(prepared.w_rot, rot.rotate_rows(w / t))
    res = quantize_tensor("w", prepared, spec, rot, torch.device("cpu"),
                          CalibOptions(_Hessians(h)))
    dw = (dequantize(res.q) - w).double()
    assert res.weighted_error == pytest.approx(float(torch.trace(dw @ h @ dw.T)), rel=1e-4)
    assert res.q.rel_error == pytest.approx(float(dw.pow(2).sum() / w.double().pow(2).sum()),
                                            rel=1e-5)
    assert torch.allclose(scale_hessian(h, t), torch.diag(t.double()) @ h @
                          torch.diag(t.double()))
    with pytest.raises(ValueError, match="col_scale 'sinkhorn' but column scales missing"):
        quantize_tensor("w", prepare_weight(w, spec.model_copy(update={"col_scale": "none"}),
                                            rot), spec, rot, torch.device("cpu"), None)


def test_a_scaled_tensor_s_factor_is_kept_only_while_it_is_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--target-bits fits one tensor at each width in a row: its H' is prepared once; the
    next tensor's replaces it (dropped first), so at most one is ever kept."""
    import tq_cli.quant.choose as choose

    made: list[int] = []
    real = choose.prepare_hessian
    monkeypatch.setattr(choose, "prepare_hessian",
                        lambda h, **k: made.append(h.shape[0]) or real(h, **k))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(512, 128, generator=g)
    calib = CalibOptions(_Hessians((x.T @ x).double() / 512))
    rot = make_rotation(RotationSpec(seed=1), 128, 64)
    slot = calib.calibration.__dict__
    for name, seed in (("a", 5), ("a", 5), ("b", 6)):
        w = _heavy_columns(32, 128, seed=seed)
        for bits in (3, 4):
            spec = QuantSpec(bits=bits, group_size=64, col_scale="sinkhorn")
            fit_weight(name, w, spec, rot, torch.device("cpu"), calib)
        assert [k[0] for k in slot["_tq_prepared_scaled"]] == [name]
    assert made == [128, 128]  # "a" once (four fits), "b" once (two)


@pytest.fixture(scope="module")
def scaled(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cs") / "tq"
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(bits=4, group_size=64), fast=True))
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(3, 40).reshape(1, -1) % model.config.vocab_size
    with torch.no_grad():
        return model(ids).logits


def test_a_conversion_stores_column_scales_by_default_and_runs_them(
        scaled: Path, cpu_gemm: str) -> None:
    man = json.loads((scaled / "tq_manifest.json").read_text())
    assert man["format_version"] == 2 and FORMAT_VERSION == 3  # no tied head: version 2
    conv = [e for e in man["tensors"] if e["action"] == "quantize"]
    # every converted weight but the head (tq_cli.quant.head: no column scales)
    assert [e["name"] for e in conv if e["spec"]["col_scale"] != "sinkhorn"] == [
        "lm_head.weight"]
    conv = [e for e in conv if e["name"] != "lm_head.weight"]
    key = conv[0]["name"] + ".col_scale"
    assert key in conv[0]["keys"]
    with safe_open(str(scaled / conv[0]["shards"][0]), "pt") as f:
        t = f.get_tensor(key)
    assert t.dtype == torch.float16 and t.shape == (conv[0]["shape"][1],)
    model = tq_cli.load(scaled)
    layers = [m for m in model.modules() if isinstance(m, TQLinear) and m is not model.lm_head]
    assert layers and all(m.col_scale is not None for m in layers)
    twin = tq_cli.load(scaled)
    twin.dequantize()
    _close(_logits(model), _logits(twin), cpu_gemm, bf16_tol=0.02)


def test_col_scale_none_stores_none(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "plain"
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(col_scale="none"), fast=True))
    man = json.loads((out / "tq_manifest.json").read_text())
    assert not any(k.endswith(".col_scale") for e in man["tensors"] for k in e["keys"])


def test_a_format_1_folder_still_loads(tiny_llama: Path, tmp_path: Path) -> None:
    """A folder written before column scales (format version 1: specs without the field)
    loads and runs as it did."""
    out = tmp_path / "v1"
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(col_scale="none"), fast=True))
    want = _logits(tq_cli.load(out))
    man = json.loads((out / "tq_manifest.json").read_text())
    man["format_version"] = 1
    for e in man["tensors"]:
        e.get("spec", {}).pop("col_scale", None)
    man["quant"].pop("col_scale")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"].pop("manifest_sha256")
    config["quantization_config"].pop("col_scale")
    config["quantization_config"]["format_version"] = 1
    man["config_sha256"] = config_digest(config)
    config["quantization_config"]["manifest_sha256"] = manifest_digest(man)
    (out / "tq_manifest.json").write_text(json.dumps(man))
    (out / "config.json").write_text(json.dumps(config))
    assert torch.equal(_logits(tq_cli.load(out)), want)


def test_a_bad_col_scale_is_a_usage_error(tiny_llama: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "o"),
                                 "--fast", "--col-scale", "rows"])
    assert r.exit_code == 2
    assert "--col-scale: Input should be 'sinkhorn' or 'none'" in r.output
    assert not (tmp_path / "o").exists()


def test_experts_get_no_column_scales(tmp_path: Path) -> None:
    """A layer's experts share one rotated routed input: planning gives them none, the
    attention around them keeps theirs, and a manifest that says otherwise is refused."""
    from families import FAMILIES
    from tinymodels import save_tiny_tokenizer

    torch.manual_seed(0)
    model, _ = FAMILIES["mixtral"]()
    src = tmp_path / "src"
    model.save_pretrained(src)
    save_tiny_tokenizer(src, model.config.vocab_size)
    out = tmp_path / "tq"
    convert(src, out, ConvertSpec(fast=True))
    man = json.loads((out / "tq_manifest.json").read_text())
    conv = [e for e in man["tensors"] if e["action"] == "quantize"]
    experts = [e for e in conv if "expert" in e]
    assert experts and all(e["spec"]["col_scale"] == "none" for e in experts)
    assert all(e["spec"]["col_scale"] == "sinkhorn" for e in conv
               if "expert" not in e and e["name"] != "lm_head.weight")
    tq_cli.load(out)  # runs
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    e = experts[0]
    e["spec"]["col_scale"] = "sinkhorn"
    with pytest.raises(tq_cli.TqError):
        _resign_and_load(bad, man)


def _resign_and_load(folder: Path, man: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["manifest_sha256"] = manifest_digest(man)
    (folder / "tq_manifest.json").write_text(json.dumps(man))
    (folder / "config.json").write_text(json.dumps(config))
    tq_cli.load(folder)


def test_fp16_activations_are_scaled_in_float32() -> None:
    """t reaches 2^15: x * t in fp16 would be inf where the layer's output is finite."""
    from tq_kernels import dispatch

    x = torch.full((1, 4), 300.0, dtype=torch.float16)
    t = torch.tensor([1.0, 298.25, 0.5, 2.0], dtype=torch.float16)
    y = dispatch.scale_columns(x, t)
    assert y.dtype == torch.float32 and torch.isfinite(y).all() and float(y[0, 1]) == 89475.0
    assert dispatch.scale_columns(x.float(), t).dtype == torch.float32
    assert dispatch.scale_columns(x.bfloat16(), t).dtype == torch.bfloat16
