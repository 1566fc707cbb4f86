"""tq search-seed: the range syntax, argmin choice, exact reproduction by convert,
resume after an interruption, and the same result from 2 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import TqError
from tq_cli.io.manifest import read_manifest
from tq_cli.quant.spec import QuantSpec
from tq_cli.seedsearch.grid import SearchSpec, search
from tq_cli.seedsearch.ranges import SeedRangeError, parse_seeds

runner = CliRunner()
QUANT = QuantSpec(bits=3, group_size=32)
SEEDS = list(range(6))


def test_parse_seeds() -> None:
    assert parse_seeds("0..100") == list(range(101))
    assert parse_seeds("0..100:5") == list(range(0, 101, 5))
    assert parse_seeds("1,7,42") == [1, 7, 42]
    assert parse_seeds("42, 3..5,4") == [3, 4, 5, 42]
    assert parse_seeds("7") == [7]


@pytest.mark.parametrize(("text", "why"), [
    ("10..5", "end 5 is before start 10"),
    ("0..10:0", "the step is 0"),
    ("a..5", "start 'a' is not a whole number"),
    ("1,,2", "an empty item between commas"),
    ("-3", "seed -3 is negative"),
    ("", "it is empty"),
    ("0..10:x", "step 'x' is not a whole number"),
    # the limit is on all items together (each of these alone is within it)
    ("0..99999,100000", "more than 100000 seeds"),
    ("0..59999,60000..119999", "more than 100000 seeds"),
])
def test_bad_seed_ranges(text: str, why: str) -> None:
    with pytest.raises(SeedRangeError) as e:
        parse_seeds(text)
    assert str(e.value) == (f"bad seed range '{text}': {why}; use START..END (inclusive), "
                            "START..END:STEP or a list like 1,7,42")


@pytest.fixture(scope="module")
def searched(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("seeds") / "seeds.json"
    doc = search(tiny_llama, out, SearchSpec(seeds=SEEDS, quant=QUANT, finalists=3,
                                             device="cpu"))
    assert doc is not None and json.loads(out.read_text()) == json.loads(json.dumps(doc))
    return doc


def test_choice_is_argmin_of_exact_scores(searched: dict) -> None:
    assert searched["summary"]["tensors"] == len(searched["tensors"]) == 14
    for t in searched["tensors"].values():
        exact = {int(s): v for s, v in t["exact"].items()}
        assert 0 in exact and len(exact) <= 4  # 3 finalists + the reference seed 0
        assert t["seed"] == min(exact, key=lambda s: (exact[s], s))
        assert t["score"] == exact[t["seed"]] and t["seed0_score"] == exact[0]
        assert t["screen"]["best"] <= t["screen"]["median"] <= t["screen"]["worst"]
        # The screen is a cruder fit: its errors sit above the exact ones.
        assert t["screen"]["best"] > t["score"]
    assert searched["summary"]["gain_over_seed0"] >= 0


def test_convert_with_seeds_reproduces_scores(searched: dict, tiny_llama: Path,
                                              tmp_path: Path) -> None:
    seeds_file = tmp_path / "seeds.json"
    seeds_file.write_text(json.dumps(searched))
    out = tmp_path / "out"
    # --fast: the searched scores are the weight-only fit's
    convert(tiny_llama, out, ConvertSpec(quant=QUANT, seeds_file=str(seeds_file),
                                         device="cpu", fast=True))
    manifest = read_manifest(out)
    assert manifest["seeds"]["file"] == "seeds.json"
    by_name = {t["name"]: t for t in manifest["tensors"]}
    for name, t in searched["tensors"].items():
        assert by_name[name]["rotation"]["seed"] == t["seed"]
        assert by_name[name]["rel_error"] == t["score"]  # exactly, not approximately


@pytest.mark.parametrize(("patch", "where", "why"), [
    ({"seed": 1.5}, "tensors.{t}.seed", "Input should be a valid integer"),
    ({"seed": "7"}, "tensors.{t}.seed", "Input should be a valid integer"),
    ({"seed": -1}, "tensors.{t}.seed", "Input should be greater than or equal to 0"),
    ({"seed": 2**64}, "tensors.{t}.seed", "Input should be less than or equal to 4294967295"),
    (None, "tensors.{t}.seed", "Field required"),
])
def test_damaged_seeds_file_is_one_line(searched: dict, tiny_llama: Path, tmp_path: Path,
                                        patch: dict | None, where: str, why: str) -> None:
    doc = json.loads(json.dumps(searched))
    name = next(iter(doc["tensors"]))
    if patch is None:
        del doc["tensors"][name]["seed"]
    else:
        doc["tensors"][name].update(patch)
    seeds_file = tmp_path / "s.json"
    seeds_file.write_text(json.dumps(doc))
    with pytest.raises(TqError) as e:
        convert(tiny_llama, tmp_path / "o", ConvertSpec(quant=QUANT, seeds_file=str(seeds_file)))
    assert str(e.value) == (f"{seeds_file}: invalid seeds file at '{where.format(t=name)}': "
                            f"{why}; make one with tq search-seed")
    assert not (tmp_path / "o").exists()


def test_seeds_file_that_is_not_json_or_a_folder(tiny_llama: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[" * 100_000)
    with pytest.raises(TqError, match="not a JSON seeds file; make one with tq search-seed"):
        convert(tiny_llama, tmp_path / "o", ConvertSpec(seeds_file=str(bad)))
    with pytest.raises(TqError, match="is a folder, not a seeds file"):
        convert(tiny_llama, tmp_path / "o", ConvertSpec(seeds_file=str(tmp_path)))


def test_seed_above_32_bits_is_refused() -> None:
    with pytest.raises(SeedRangeError, match="above the largest seed 4294967295"):
        parse_seeds("0..4294967296")


def test_seeds_for_another_model_refused(searched: dict, tiny_bert: Path, tmp_path: Path,
                                         tiny_llama: Path) -> None:
    seeds_file = tmp_path / "s.json"
    seeds_file.write_text(json.dumps(searched))
    with pytest.raises(TqError) as e:
        convert(tiny_bert, tmp_path / "o", ConvertSpec(seeds_file=str(seeds_file)))
    assert str(e.value) == (f"{seeds_file}: seeds were searched for model 'tiny-llama', not "
                            f"for 'tiny-bert' (fingerprints differ); run tq search-seed on "
                            f"{tiny_bert}")
    with pytest.raises(TqError, match="searched for --rotation hadamard, but this conversion "
                                      "uses --rotation orthogonal"):
        convert(tiny_llama, tmp_path / "o2", ConvertSpec.model_validate(
            {"seeds_file": str(seeds_file), "rotation": {"kind": "orthogonal"}}))


def test_resume_after_interruption(searched: dict, tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "seeds.json"
    spec = SearchSpec(seeds=SEEDS, quant=QUANT, finalists=3, device="cpu")

    def stop_after_5(name: str, done: int, total: int) -> None:
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search(tiny_llama, out, spec, progress=stop_after_5)
    assert not out.exists()
    lines = (tmp_path / "seeds.json.log" / "rank0.jsonl").read_text().splitlines()
    assert len(lines) > 1
    calls: list[str] = []
    doc = search(tiny_llama, out, spec, progress=lambda n, d, t: calls.append(n))
    assert doc is not None
    assert doc["tensors"] == searched["tensors"]
    lines2 = (tmp_path / "seeds.json.log" / "rank0.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines2[1:]]
    keys = [(r["t"], r["s"], r["stage"]) for r in records]
    assert len(keys) == len(set(keys))  # nothing scored twice


def test_log_from_other_settings_refused(searched: dict, tiny_llama: Path,
                                         tmp_path: Path) -> None:
    out = tmp_path / "seeds.json"
    search(tiny_llama, out, SearchSpec(seeds=[0, 1], quant=QUANT, device="cpu"))
    with pytest.raises(TqError, match="made with other settings or another model; delete"):
        search(tiny_llama, out, SearchSpec(seeds=[0, 1], quant=QuantSpec(bits=4,
                                                                         group_size=32)))


def test_per_model_picks_one_seed(tiny_llama: Path, tmp_path: Path) -> None:
    doc = search(tiny_llama, tmp_path / "m.json",
                 SearchSpec(seeds=SEEDS, quant=QUANT, per="model", finalists=2, device="cpu"))
    assert doc is not None
    chosen = {t["seed"] for t in doc["tensors"].values()}
    assert chosen == {doc["summary"]["model_seed"]}
    numel = {n: t["numel"] for n, t in doc["tensors"].items()}
    common = set.intersection(*({int(s) for s in t["exact"]} for t in doc["tensors"].values()))
    total = {s: sum(doc["tensors"][n]["exact"][str(s)] * numel[n] for n in numel)
             for s in common & set(SEEDS)}
    assert doc["summary"]["model_seed"] == min(total, key=lambda s: (total[s], s))


def test_cli_table_and_json(tiny_llama: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["search-seed", str(tiny_llama), "0..2", "-o",
                            str(tmp_path / "s.json"), "--bits", "3", "--group-size", "32",
                            "--exhaustive", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert all(len(t["exact"]) == 3 for t in doc["tensors"].values())
    r = runner.invoke(app, ["search-seed", str(tiny_llama), "5..1", "-o",
                            str(tmp_path / "s.json")])
    assert r.exit_code == 1 and "end 1 is before start 5" in r.stderr


def _run_cli(args: list[str], env_extra: dict[str, str] | None = None) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_two_gloo_ranks_match_one_process(searched: dict, tiny_llama: Path,
                                          tmp_path: Path) -> None:
    common = [str(tiny_llama), "0..5", "--bits", "3", "--group-size", "32", "--finalists", "3",
              "--device", "cpu", "--json"]
    torchrun = tmp_path / "torchrun.json"
    _run_cli([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", "-m", "tq_cli", "search-seed", *common[:1], common[1],
              "-o", str(torchrun), *common[2:]])
    jobs = tmp_path / "jobs.json"
    _run_cli([sys.executable, "-m", "tq_cli", "search-seed", *common[:2], "-o", str(jobs),
              "--jobs", "2", *common[2:]])
    for path in (torchrun, jobs):
        doc = json.loads(path.read_text())
        assert doc["ranks"] == 2
        assert doc["tensors"] == searched["tensors"]
        logs = sorted(p.name for p in (path.parent / f"{path.name}.log").iterdir())
        assert logs == ["rank0.jsonl", "rank1.jsonl"]
