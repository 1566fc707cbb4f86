"""The output Fisher measured block by block equals the whole model's backward pass, and
`--target-bits` ranks widths by it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tinymodels import build_tiny_llama
from torch import nn

from tq_cli.calibration.fisher import fisher_cost, output_fisher
from tq_cli.calibration.random_tokens import synthetic_run
from tq_cli.planning.prepare import plan_source


def _reference(folder: Path, seqs: torch.Tensor, batch: int, seed: int,
               names: list[str]) -> dict[str, torch.Tensor]:
    """E[g_i^2] from the whole model's own backward pass, the same tokens drawn."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    acc = {n: torch.zeros(model.get_submodule(n.removesuffix(".weight")).out_features,
                          dtype=torch.float64) for n in names}
    handles = []
    for n in names:
        def hook(_m: nn.Module, _a: tuple, out: torch.Tensor, n: str = n) -> None:
            def add(g: torch.Tensor) -> None:
                acc[n].add_(g.reshape(-1, g.shape[-1]).pow(2).sum(0, dtype=torch.float64))
            out.register_hook(add)
        handles.append(model.get_submodule(n.removesuffix(".weight")).register_forward_hook(hook))
    gen = torch.Generator().manual_seed(seed)
    emb = model.get_input_embeddings()
    for i in range(0, seqs.shape[0], batch):
        x = emb(seqs[i:i + batch]).detach().requires_grad_(True)  # so the graph is built
        logits = model(inputs_embeds=x, use_cache=False).logits.float()
        flat = logits.reshape(-1, logits.shape[-1])
        drawn = torch.multinomial(flat.detach().softmax(-1), 1, generator=gen)[:, 0]
        nn.functional.cross_entropy(flat, drawn, reduction="sum").backward()
    for h in handles:
        h.remove()
    return {n: a / seqs.numel() for n, a in acc.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_block_by_block_equals_the_whole_models_backward(tiny_llama: Path, tmp_path: Path,
                                                         tied: bool) -> None:
    source = (build_tiny_llama(tmp_path / "tied", layers=3, tied=True, seed=3) if tied
              else tiny_llama)
    planned = plan_source(source, None)
    run, _ = synthetic_run(planned, 256, 0, tmp_path, "cpu")
    got = output_fisher(run, tmp_path / "states", seed=5)
    assert got.tokens == run.seqs.numel() and not got.missing
    blocks = [n for n in planned.converted_names if n.startswith("model.layers.")]
    assert sorted(got.fisher) == sorted(blocks)
    want = _reference(source, run.seqs, run.batch, 5, blocks)
    for n in blocks:
        torch.testing.assert_close(got.fisher[n], want[n], rtol=2e-4, atol=1e-12)
        assert bool((got.fisher[n] > 0).all()), n
    assert not list((tmp_path / "states").iterdir())  # the saved block inputs are gone


def test_fisher_cost_weighs_each_row() -> None:
    f = torch.tensor([1.0, 0.0, 4.0], dtype=torch.float64)
    rows = torch.tensor([2.0, 100.0, 0.5], dtype=torch.float64)
    assert fisher_cost(f, rows) == pytest.approx(0.5 * (2.0 + 2.0))


def test_target_bits_weighs_errors_by_the_fisher(tiny_llama: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tq_cli.app import app

    r = CliRunner().invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "o"),
                                 "--group-size", "32", "--synthetic-calib", "256",
                                 "--target-bits", "3", "--json"])
    assert r.exit_code == 0, r.output
    mixed = json.loads(r.stdout)["mixed_precision"]
    assert mixed["error"] == "fisher-weighted" and "fisher_unused" not in mixed
    assert mixed["fisher_tokens"] == 4096 and mixed["achieved_bits"] <= 3


def test_an_encoders_fisher_is_that_of_its_hidden_states(tiny_bert: Path,
                                                          tmp_path: Path) -> None:
    """A model without an LM head (an encoder's output is its hidden states): F from the
    gradients of <v, y> with v ~ N(0, I), as the whole model's own backward pass gives."""
    from transformers import AutoModel

    planned = plan_source(tiny_bert, None)
    run, _ = synthetic_run(planned, 128, 0, tmp_path, "cpu")
    got = output_fisher(run, tmp_path / "states", seed=3)
    names = [n for n in planned.converted_names if ".layer." in n]
    assert names and sorted(got.fisher) == sorted(names)
    model = AutoModel.from_pretrained(tiny_bert, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    acc = {n: torch.zeros(got.fisher[n].shape, dtype=torch.float64) for n in names}
    for n in names:
        def hook(_m: nn.Module, _a: tuple, out: torch.Tensor, n: str = n) -> None:
            def add(g: torch.Tensor) -> None:
                acc[n].add_(g.reshape(-1, g.shape[-1]).pow(2).sum(0, dtype=torch.float64))
            out.register_hook(add)
        model.get_submodule(n.removesuffix(".weight")).register_forward_hook(hook)
    gen = torch.Generator().manual_seed(3)
    emb = model.get_input_embeddings()
    for i in range(0, run.seqs.shape[0], run.batch):
        ids = run.seqs[i:i + run.batch]
        x = emb(ids).detach().requires_grad_(True)
        y = model(inputs_embeds=x).last_hidden_state
        y.backward(torch.randn(y.shape, generator=gen))
    for n in names:
        torch.testing.assert_close(got.fisher[n], acc[n] / run.seqs.numel(), rtol=2e-4,
                                   atol=1e-12)
