"""tq calibrate: block-at-a-time H equals a whole-model pass, groups, file format, errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import tq_cli.calibration.collect as calib_mod
import tq_cli.calibration.skeleton as skeleton_mod
from tq_cli.app import app
from tq_cli.calibration.collect import CalibResult, CalibSpec, calibrate, token_sequences
from tq_cli.errors import CorruptFileError, OutputError, TqError
from tq_cli.io.calibration import CalibrationMismatchError, read_calibration
from tq_cli.io.safetensors_reader import open_source
from tq_cli.io.text import Text, calibration_text

SAMPLES, SEQLEN, BATCH = 6, 32, 4  # 6 = 4 + 2: the last batch is short on purpose
HEAD_RECIPE = """
name = "llama-head"
input_groups = [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]

[[rules]]
pattern = "*.self_attn.[qkvo]_proj.weight"

[[rules]]
pattern = "*.mlp.*_proj.weight"

[[rules]]
pattern = "lm_head.weight"
"""


@pytest.fixture(scope="module")
def head_recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "llama-head.toml"
    path.write_text(HEAD_RECIPE)
    return path


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, head_recipe: Path,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CalibResult]:
    """tiny_llama calibrated once, with lm_head converted too (a layer after the blocks)."""
    out = tmp_path_factory.mktemp("calib") / "tiny.calib"
    spec = CalibSpec(samples=SAMPLES, seqlen=SEQLEN, batch_size=BATCH, device="cpu",
                     recipe=str(head_recipe))
    return out, calibrate(tiny_llama, out, spec)


def whole_model_hessians(folder: Path, seqs: torch.Tensor,
                         batch: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Sum x x^T per nn.Linear from one plain full-model forward pass with hooks."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple], None]:
        def pre(_m: nn.Module, args: tuple) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
                                  ) + (x.T @ x).double()
            rows[name] = rows.get(name, 0) + x.shape[0]
        return pre

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for i in range(0, seqs.shape[0], batch):
            model(input_ids=seqs[i:i + batch], use_cache=False)
    return sums, rows


def test_matches_whole_model_pass(tiny_llama: Path,
                                  calibrated: tuple[Path, CalibResult]) -> None:
    from transformers import AutoTokenizer

    out, _ = calibrated
    seqs = token_sequences(AutoTokenizer.from_pretrained(tiny_llama), calibration_text(),
                           SAMPLES, SEQLEN)
    sums, rows = whole_model_hessians(tiny_llama, seqs, BATCH)
    cal = read_calibration(out)
    assert "lm_head.weight" in cal.tensors  # after the final norm: calibrated too
    for name in cal.tensors:
        module = name.removesuffix(".weight")
        ref = sums[module] / rows[module]
        got = cal.hessian(name)
        assert got is not None and got.dtype == torch.float32  # as stored
        assert cal.tokens(name) == rows[module] == SAMPLES * SEQLEN
        torch.testing.assert_close(got.double(), ref, rtol=1e-5,
                                   atol=1e-6 * float(ref.abs().max()))


def test_groups_share_one_matrix_and_cover_every_converted_tensor(
        tiny_llama: Path, head_recipe: Path, calibrated: tuple[Path, CalibResult]) -> None:
    from tq_cli.planning.plan import make_plan
    from tq_cli.planning.recipe import load_recipe
    from tq_cli.quant.spec import QuantSpec, RotationSpec

    out, result = calibrated
    cal = read_calibration(out)
    plan = make_plan(open_source(tiny_llama), load_recipe(head_recipe), QuantSpec(),
                     RotationSpec())
    converted = {t.info.name for t in plan.converted}
    assert set(cal.tensors) == converted
    for i in range(2):
        p = f"model.layers.{i}."
        keys = {n: cal.tensors[p + n + ".weight"] for n in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        assert keys["self_attn.q_proj"] == keys["self_attn.k_proj"] == keys["self_attn.v_proj"]
        assert keys["mlp.gate_proj"] == keys["mlp.up_proj"]
        assert len(set(keys.values())) == 4
    assert result.groups == len(set(cal.tensors.values())) == 2 * 4 + 1
    assert len([k for k in cal.entries if k.startswith("hessian.")]) == result.groups
    assert result.calibrated == len(converted) and result.uncalibrated == []
    q = cal.hessian("model.layers.0.self_attn.q_proj.weight")
    v = cal.hessian("model.layers.0.self_attn.v_proj.weight")
    assert q is not None and v is not None and torch.equal(q, v)
    assert result.tokens == SAMPLES * SEQLEN


def test_file_is_plain_safetensors_with_tq_metadata(
        tiny_llama: Path, calibrated: tuple[Path, CalibResult]) -> None:
    from safetensors import safe_open

    out, result = calibrated
    cal = read_calibration(out)
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()["tq_calibration"])
        key = cal.tensors["model.layers.1.mlp.down_proj.weight"]
        mean = f.get_tensor(f"hessian.{key}")
        count = f.get_tensor(f"tokens.{key}")
    assert mean.dtype == torch.float32 and mean.shape == (200, 200)
    assert count.dtype == torch.int64 and int(count) == SAMPLES * SEQLEN
    h = cal.hessian("model.layers.1.mlp.down_proj.weight")
    assert h is not None and torch.equal(h, mean.double())
    assert meta["format_version"] == 1 and meta["tq_version"] == calib_mod.__version__
    assert meta["source"]["fingerprint"] == open_source(tiny_llama).fingerprint
    assert meta["source"]["name"] == tiny_llama.name
    assert meta["text"]["sha256"] == calibration_text().sha256
    assert (meta["samples"], meta["seqlen"], meta["tokens"]) == (SAMPLES, SEQLEN, result.tokens)
    assert meta["recipe"] == "llama-head" and meta["tensors"] == cal.tensors
    assert out.stat().st_size == result.file_bytes
    assert not list(out.parent.glob(".*tq-partial"))
    assert cal.hessian("model.embed_tokens.weight") is None
    assert cal.tokens("model.embed_tokens.weight") == 0
    assert len(cal.sha256) == 64


def test_check_source_refuses_another_model(tiny_llama: Path, tmp_path: Path,
                                            calibrated: tuple[Path, CalibResult]) -> None:
    from transformers import LlamaForCausalLM

    out, _ = calibrated
    other = tmp_path / "other-llama"
    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)
    model.save_pretrained(other, max_shard_size="100KB")
    cal = read_calibration(out)
    cal.check_source(open_source(tiny_llama))  # its own model passes
    theirs, mine = open_source(other), open_source(tiny_llama)
    with pytest.raises(CalibrationMismatchError) as e:
        cal.check_source(theirs)
    assert str(e.value) == (
        f"{out}: made for model 'tiny-llama' ({mine.fingerprint[7:19]}), not for the model "
        f"given, 'other-llama' ({theirs.fingerprint[7:19]}); run tq calibrate on {other}")
    assert isinstance(e.value, TqError)


def test_short_text_warns_and_too_short_text_fails(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    text = tmp_path / "short.txt"
    text.write_text("Paragraph talks about topic at some length with words and more. " * 3)
    n = len(AutoTokenizer.from_pretrained(tiny_llama)(text.read_text())["input_ids"])
    seqlen = n // 2  # two sequences fit, four are asked for
    warned: list[str] = []
    r = calibrate(tiny_llama, tmp_path / "c.calib",
                  CalibSpec(text=str(text), samples=4, seqlen=seqlen, device="cpu"),
                  warn=warned.append)
    assert r.samples == 2 and r.tokens == 2 * seqlen
    assert warned == [f"{text}: {n} tokens make only 2 sequences of {seqlen} (asked for 4); "
                      f"calibrating on {2 * seqlen} tokens. Pass a longer --text for more"]
    assert r.warnings == warned
    with pytest.raises(TqError) as e:
        calibrate(tiny_llama, tmp_path / "d.calib",
                  CalibSpec(text=str(text), samples=4, seqlen=n + 1, device="cpu"))
    assert str(e.value) == (f"{text}: only {n} tokens, fewer than one sequence of --seqlen "
                            f"{n + 1}; pass a longer --text or a smaller --seqlen")
    assert not (tmp_path / "d.calib").exists()


def test_token_sequences_are_consecutive_cuts() -> None:
    class Tok:
        def __call__(self, text: str, verbose: bool = True) -> dict[str, list[int]]:
            return {"input_ids": list(range(len(text)))}

    seqs = token_sequences(Tok(), Text("x" * 23, "t"), samples=3, seqlen=5)
    assert seqs.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]


def test_one_block_materialised_at_a_time(tiny_llama: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    models: list[nn.Module] = []
    build, read = calib_mod.build_skeleton, skeleton_mod.read_tensor
    reads: list[str] = []

    def spy_build(folder: Path, config: dict) -> nn.Module:
        models.append(build(folder, config))
        return models[-1]

    def real_blocks() -> set[int]:
        blocks: nn.ModuleList = models[0].get_submodule("model.layers")  # type: ignore[assignment]
        return {i for i, b in enumerate(blocks)
                if any(p.device.type != "meta" for p in b.parameters())}

    def spy_read(info: skeleton_mod.TensorInfo) -> torch.Tensor:
        reads.append(info.name)
        if info.name.startswith("model.layers."):
            # While block i loads, no other block holds real weights.
            assert real_blocks() <= {int(info.name.split(".")[2])}
        return read(info)

    monkeypatch.setattr(calib_mod, "build_skeleton", spy_build)
    monkeypatch.setattr(skeleton_mod, "read_tensor", spy_read)
    calibrate(tiny_llama, tmp_path / "c.calib",
              CalibSpec(samples=2, seqlen=16, device="cpu"))
    assert real_blocks() == set()
    assert all(p.device.type == "meta" for p in models[0].parameters())
    # Every block weight was read exactly once, and lm_head (not needed) never.
    block_reads = [r for r in reads if r.startswith("model.layers.")]
    assert len(block_reads) == len(set(block_reads)) == 2 * 9
    assert "lm_head.weight" not in reads


def test_output_refusals_and_no_half_file(tiny_llama: Path, tmp_path: Path) -> None:
    spec = CalibSpec(samples=2, seqlen=16, device="cpu")
    with pytest.raises(OutputError, match="inside the source model folder"):
        calibrate(tiny_llama, tiny_llama / "c.calib", spec)
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    with pytest.raises(OutputError) as e:
        calibrate(tiny_llama, other, spec)
    assert str(e.value) == (f"{other}: exists and is not a tq calibration file; remove it or "
                            "choose another path")
    assert other.read_text() == "keep me"

    def boom(done: int, total: int) -> None:
        raise TqError("stop")

    out = tmp_path / "c.calib"
    with pytest.raises(TqError, match="stop"):
        calibrate(tiny_llama, out, spec, progress=boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    calibrate(tiny_llama, out, spec)
    calibrate(tiny_llama, out, spec)  # replacing a calibration file is fine
    assert read_calibration(out).meta["samples"] == 2


def test_damaged_and_foreign_files(tiny_llama: Path, tmp_path: Path,
                                   calibrated: tuple[Path, CalibResult]) -> None:
    out, _ = calibrated
    cut = tmp_path / "cut.calib"
    cut.write_bytes(out.read_bytes()[:5000])
    with pytest.raises(CorruptFileError) as e:
        read_calibration(cut)
    assert str(e.value).startswith(f"{cut}: damaged or not a calibration file (")
    assert str(e.value).endswith("); rerun tq calibrate")
    shard = next(tiny_llama.glob("*.safetensors"))
    with pytest.raises(CorruptFileError) as e:
        read_calibration(shard)
    assert str(e.value) == (f"{shard}: not a tq calibration file (no 'tq_calibration' "
                            "metadata); make one with tq calibrate")
    with pytest.raises(TqError, match="no such calibration file"):
        read_calibration(tmp_path / "missing.calib")


def test_each_group_is_checked_against_its_digest(tmp_path: Path,
                                                  calibrated: tuple[Path, CalibResult]) -> None:
    """A flipped byte inside a Hessian (the header intact) used to be read as data."""
    out, _ = calibrated
    calib = read_calibration(out)
    assert set(calib.meta["digests"]) == set(calib.meta["tensors"].values())
    name, key = next(iter(calib.meta["tensors"].items()))
    assert calib.hessian(name) is not None  # an intact file reads
    damaged = tmp_path / "damaged.calib"
    data = bytearray(out.read_bytes())
    entry = calib.entries[f"hessian.{key}"]
    data[entry.offset + 100] ^= 0x40
    damaged.write_bytes(bytes(data))
    bad = read_calibration(damaged)  # the header is fine: it opens
    with pytest.raises(CorruptFileError) as e:
        bad.hessian(name)
    assert str(e.value) == (f"{damaged}: the statistics of '{name}' (group '{key}') do not "
                            "match their digest; the file is damaged, rerun tq calibrate")


def test_cli_json_and_errors(tiny_llama: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "c.calib"
    r = runner.invoke(app, ["calibrate", str(tiny_llama), "-o", str(out), "--samples", "2",
                            "--seqlen", "16", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["layers"] == 14 and data["groups"] == 8 and data["tokens"] == 32
    assert {"seconds", "file_bytes", "uncalibrated", "out"} <= set(data)
    r = runner.invoke(app, ["calibrate", str(tmp_path / "missing"), "-o", str(out)])
    assert r.exit_code == 1
    assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1
    r = runner.invoke(app, ["calibrate", str(tiny_llama), "-o", str(out), "--samples", "0"])
    assert r.exit_code == 2 and "--samples" in r.stderr


def test_bert_encoder(tiny_bert: Path, tmp_path: Path) -> None:
    r = calibrate(tiny_bert, tmp_path / "b.calib", CalibSpec(samples=2, seqlen=32, device="cpu"))
    cal = read_calibration(r.out)
    keys = {cal.tensors[f"encoder.layer.0.attention.self.{n}.weight"]
            for n in ("query", "key", "value")}
    assert keys == {"encoder.layer.0.attention.self.query+key+value"}
    assert r.calibrated == 12 and r.groups == 8 and r.uncalibrated == []


def test_a_recipe_converting_an_embedding_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    # The loader runs converted nn.Linear layers only, so planning refuses an embedding
    # for calibrate as for convert, before any model runs.
    recipe = tmp_path / "r.toml"
    recipe.write_text(HEAD_RECIPE.replace('pattern = "lm_head.weight"',
                                          'pattern = "model.embed_tokens.weight"'))
    with pytest.raises(TqError, match=r"tensor 'model\.embed_tokens\.weight' is an embedding "
                                      r"table, but recipe 'llama-head' converts it"):
        calibrate(tiny_llama, tmp_path / "c.calib",
                  CalibSpec(samples=2, seqlen=16, device="cpu", recipe=str(recipe)))
    assert not (tmp_path / "c.calib").exists()


def test_wrong_input_group_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(HEAD_RECIPE.replace('[["q_proj", "k_proj", "v_proj"], ',
                                          '[["q_proj", "o_proj"], '))
    with pytest.raises(TqError, match=r"recipe 'llama-head': input_groups puts "
                       r"model\.layers\.0\.self_attn\.q_proj, model\.layers\.0\.self_attn"
                       r"\.o_proj together, but they read different inputs"):
        calibrate(tiny_llama, tmp_path / "c.calib",
                  CalibSpec(samples=2, seqlen=16, device="cpu", recipe=str(recipe)))
    assert not (tmp_path / "c.calib").exists()


def test_a_group_s_last_reader_takes_the_cached_matrix(
        calibrated: tuple[Path, CalibResult]) -> None:
    """q, k and v share one H: the first two get copies, the last the cached matrix itself
    (no second n x n alive), and a later ask reads the file again, with the same values."""
    cal = read_calibration(calibrated[0])
    groups = cal.meta["groups"]
    key, members = next((k, m) for k, m in groups.items() if len(m) == 3)
    got = [cal.hessian(m) for m in members]
    assert all(h is not None for h in got)
    assert key not in cal._cache  # handed to the last reader
    again = cal.hessian(members[0])
    assert again is not None and all(torch.equal(h, again) for h in got)  # type: ignore[arg-type]
    got[2].zero_()  # type: ignore[union-attr]  # the reader's own: nothing else changes
    assert torch.equal(cal.hessian(members[1]), again)  # type: ignore[arg-type]
