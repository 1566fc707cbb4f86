"""`tq eval`: compare a candidate with its reference, or sweep conversion settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.progress import Progress
from rich.table import Table

from tq_cli.commands._common import emit_json, progress_bar, run_library, stderr, stdout

HELP = "Measure what quantization costs: perplexity, KL and agreement, or embedding fidelity."
EPILOG = """Examples:

  tq eval ./smol-tq4                       (reference: the source named in its manifest)

  tq eval ./smol-tq4 --reference ./SmolLM2-135M --context 1024 --stride 512 --json

  tq eval ./SmolLM2-135M --sweep "bits=3,4 rotation=none,hadamard group-size=64,128"
"""


def _progress() -> Progress:
    return progress_bar()


def main(
    candidate: str = typer.Argument(..., help="tq checkpoint, model folder or hub id "
                                              "(with --sweep: the source to convert)."),
    reference: str | None = typer.Option(None, "--reference",
                                         help="Reference model (default: the manifest's "
                                              "source)."),
    text: Path | None = typer.Option(None, "--text", help="UTF-8 text file (default: the "
                                                           "embedded pydoc evaluation split)."),
    context: int = typer.Option(512, "--context", help="Tokens per window."),
    stride: int | None = typer.Option(None, "--stride",
                                      help="Sliding-window stride (default: non-overlapping)."),
    max_tokens: int = typer.Option(8192, "--max-tokens",
                                   help="Tokens of the text to use (0 = all)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    sweep: str | None = typer.Option(None, "--sweep", help='Grid, e.g. "bits=2,3,4 '
                                     'rotation=none,hadamard codebook=lloyd-max,uniform".'),
    rtn: bool = typer.Option(True, "--rtn/--no-rtn",
                             help="With --sweep: add round-to-nearest rows."),
    scratch: Path | None = typer.Option(None, "--scratch",
                                        help="With --sweep: where scratch checkpoints go."),
    write_card: bool = typer.Option(False, "--write-card",
                                    help="Add the result to the candidate's card and manifest."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    from tq_cli.evaluate import EvalSpec
    from tq_cli.text import read_text

    if device not in ("auto", "cpu", "cuda"):
        stderr.print(f"[bold red]usage error:[/] --device: '{device}' is not auto, cpu or cuda")
        raise typer.Exit(code=2)
    spec = EvalSpec(context=context, stride=stride, max_tokens=max_tokens or None,
                    device=device)
    body = run_library(lambda: read_text(text))
    if sweep is not None:
        _sweep(candidate, sweep, rtn, body, spec, scratch, as_json)
        return
    from tq_cli.evaluate import evaluate
    from tq_cli.evaluate import write_card as record

    with _progress() as bar:
        task = bar.add_task("windows", total=None)
        result = run_library(lambda: evaluate(
            candidate, reference, body, spec,
            progress=lambda done, total: bar.update(task, completed=done, total=total)))
    if write_card:
        run_library(lambda: record(Path(result["candidate"]), result))
    if as_json:
        emit_json(result)
    else:
        stdout.print(result_table(result))


def result_table(r: dict[str, Any]) -> Table:
    t = Table(title=f"tq eval: {r['candidate']} vs {r['reference']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    m = r["metrics"]
    if r["kind"] == "causal-lm":
        rows = [("reference perplexity", f"{m['reference_perplexity']:.4f}"),
                ("candidate perplexity", f"{m['candidate_perplexity']:.4f}"),
                ("mean KL (nats/token)", f"{m['kl_mean']:.5f}"),
                ("top-1 agreement", f"{m['top1_agreement']:.4f}"),
                ("scored tokens", str(m["scored_tokens"]))]
    else:
        rows = [("cosine mean", f"{m['cosine_mean']:.5f}"),
                ("cosine min", f"{m['cosine_min']:.5f}"),
                ("similarity Spearman", f"{m['similarity_spearman']:.5f}"),
                ("sentences", str(m["sentences"]))]
    if "bits_per_weight" in r:
        rows.insert(0, ("bits per weight", f"{r['bits_per_weight']:.4f}"))
    s = r["settings"]
    rows.append(("settings", ", ".join(f"{k}={v}" for k, v in s.items()
                                       if k not in ("text_source",))))
    rows.append(("text", s["text_source"]))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _sweep(source: str, grid: str, rtn: bool, text: Any, spec: Any, scratch: Path | None,
           as_json: bool) -> None:
    from tq_cli.sweep import parse_sweep, run_sweep, with_rtn

    combos = run_library(lambda: parse_sweep(grid))
    if rtn:
        combos = with_rtn(combos)
    with _progress() as bar:
        task = bar.add_task("combinations", total=len(combos))
        rows = run_library(lambda: run_sweep(
            source, combos, text, spec, scratch,
            on_row=lambda row, done, total: bar.update(task, completed=done)))
    if as_json:
        emit_json({"source": source, "grid": grid, "rows": rows})
        return
    stdout.print(sweep_table(rows))


def sweep_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="tq eval --sweep")
    keys = sorted({k for r in rows for k in r["settings"]})
    for k in ["", *keys, "bpw"]:
        t.add_column(k)
    causal = rows and "kl_mean" in rows[0]["metrics"]
    metric_cols = (["ppl", "KL", "top-1"] if causal else ["cos mean", "cos min", "spearman"])
    for k in [*metric_cols, "convert s"]:
        t.add_column(k, justify="right")
    for r in rows:
        m = r["metrics"]
        vals = ([f"{m['candidate_perplexity']:.3f}", f"{m['kl_mean']:.4f}",
                 f"{m['top1_agreement']:.3f}"] if causal else
                [f"{m['cosine_mean']:.4f}", f"{m['cosine_min']:.4f}",
                 f"{m['similarity_spearman']:.4f}"])
        t.add_row(r["label"], *[str(r["settings"].get(k, "")) for k in keys],
                  f"{r['bits_per_weight']:.3f}", *vals, f"{r['convert_seconds']:.1f}")
    if causal and rows:
        t.caption = (f"reference perplexity {rows[0]['metrics']['reference_perplexity']:.3f} "
                     f"on {rows[0]['metrics']['scored_tokens']} tokens")
    return t


