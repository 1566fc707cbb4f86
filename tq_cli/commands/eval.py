"""`tq eval`: flags -> the mode's spec (tq_cli.commands.eval_modes) -> the library -> a
table or --json. Modes: the quality comparison (the default), the KV cache (--kv-bits,
--needle) and the sweep (--sweep)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from tq_cli.commands._common import bound_heap_growth, emit_json, progress_bar, stdout
from tq_cli.commands.eval_modes import spec_from_flags
from tq_cli.evaluation.spec import CompareSpec, KVEvalSpec, SweepSpec
from tq_cli.io.text import Text, read_text

HELP = ("Measure what quantization costs: perplexity, KL and agreement, embedding fidelity, "
        "or image-text agreement.")
EPILOG = """Examples:

  tq eval ./smol-tq4                       (reference: the source named in its manifest)

  tq eval ./smol-tq4 --reference ./SmolLM2-135M --context 1024 --stride 512 --json

  tq eval ./SmolLM2-135M --sweep "bits=3,4 rotation=none,hadamard group-size=64,128"

  tq eval ./SmolLM2-135M --kv-bits 4,3.5,3,2.5 --kv-window 128 --needle

  tq eval ./clip-tq4 --images ./my-photos  (CLIP/SigLIP; default: scikit-image's photos)

Image-text models (CLIP, SigLIP) are compared on photographs, not text: the cosine of
the candidate's image and caption embeddings to the reference's, and zero-shot agreement
(does it pick the reference's caption for each photograph among a fixed list). Without
--images: the labelled photographs that ship in scikit-image's wheel (downloaded once).

KV cache (--kv-bits): each window's first half is prefilled through the cache, the rest
is scored in chunks of --kv-chunk tokens that read it, against the same model with a
full-precision cache. Items: average bits (3.5 = keys 4 + values 3 with --kv-split kv),
or k<bits>, v<bits>, k<bits>v<bits> (a stream not named stays full precision).
"""


def main(
    ctx: typer.Context,
    candidate: str = typer.Argument(..., help="tq checkpoint, model folder or hub id "
                                              "(with --sweep: the source to convert)."),
    reference: str | None = typer.Option(None, "--reference",
                                         help="Reference model (default: the manifest's "
                                              "source)."),
    text: Path | None = typer.Option(None, "--text", help="UTF-8 text file (default: the "
                                                           "embedded pydoc evaluation split)."),
    context: int | None = typer.Option(None, "--context", help="Tokens per window (default "
                                       "512; 2048 with --kv-bits or --needle)."),
    stride: int | None = typer.Option(None, "--stride",
                                      help="Sliding-window stride (default: non-overlapping)."),
    max_tokens: int = typer.Option(8192, "--max-tokens",
                                   help="Tokens of the text to use (0 = all)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    sweep: str | None = typer.Option(None, "--sweep", help='Grid, e.g. "bits=2,3,4 '
                                     'rotation=none,hadamard codebook=lloyd-max,uniform".'),
    rtn: bool = typer.Option(True, "--rtn/--no-rtn",
                             help="With --sweep: add round-to-nearest rows."),
    scratch: Path | None = typer.Option(None, "--scratch",
                                        help="With --sweep: where scratch checkpoints go."),
    write_card: bool = typer.Option(False, "--write-card",
                                    help="Add the result to the candidate's card and manifest."),
    images: Path | None = typer.Option(None, "--images", help="Image-text models: a folder of "
                                       "PNG/JPEG files, unlabelled (default: scikit-image's "
                                       "labelled photographs)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    kv_bits: str | None = typer.Option(None, "--kv-bits", help="Measure TurboQuant KV caches "
                                       "instead of weights, e.g. 4,3.5,3,2.5 or k4,v3."),
    kv_window: int = typer.Option(128, "--kv-window", help="Recent tokens kept in full "
                                  "precision."),
    kv_split: str = typer.Option("kv", "--kv-split", help="Fractional bits: kv (keys get the "
                                 "extra bit) | outlier (a fixed channel set at one more bit)."),
    kv_sinks: int | None = typer.Option(None, "--kv-sinks", help="First tokens kept in full "
                                        "precision (default: the cache's, 1)."),
    kv_center_keys: bool | None = typer.Option(
        None, "--kv-center-keys/--no-kv-center-keys", help="Keys: code each key minus a "
        "per-head mean taken before RoPE (default: on)."),
    kv_rescale: str | None = typer.Option(None, "--kv-rescale", help="The stored scale: none "
                                          "(the norm) | norm (|x_hat| = |x|, default) | "
                                          "unbiased."),
    kv_full_layers: str = typer.Option("", "--kv-full-layers", help="Layers kept in full "
                                       "precision, e.g. 0,-1."),
    kv_rotation: str = typer.Option("hadamard", "--kv-rotation", help="hadamard | orthogonal."),
    kv_sliding: str = typer.Option("full", "--kv-sliding", help="Sliding-window layers: full "
                                   "(kept in full precision) | quantize."),
    kv_qjl: bool = typer.Option(False, "--kv-qjl", help="Keys: 1 bit of the budget on a QJL "
                                "sketch of the residual (unbiased inner products)."),
    kv_chunk: int = typer.Option(32, "--kv-chunk", help="Tokens per scoring forward."),
    kv_attention: str = typer.Option("codes", "--kv-attention", help="codes: forwards of up "
                                     "to 8 tokens attend on the coded past where the model "
                                     "runs sdpa and hands attention the cache's keys as "
                                     "they are (checked per layer) | decode: every coded "
                                     "token decoded first (the reference)."),
    kv_compare: str = typer.Option("", "--kv-compare", help="Also transformers' QuantizedCache"
                                   " at the integer --kv-bits: quanto,hqq."),
    needle: bool = typer.Option(False, "--needle", help="Passkey retrieval (greedy, exact "
                                "match) with each cache and a full-precision one."),
    needle_lengths: str = typer.Option("2048,4096", "--needle-lengths",
                                       help="Prompt lengths in tokens."),
    needle_seeds: int = typer.Option(2, "--needle-seeds", help="Passkeys per length and "
                                     "depth (5 depths)."),
) -> None:
    spec = spec_from_flags(ctx)  # exit 2 with one line for a flag the mode does not read
    if isinstance(spec, KVEvalSpec):
        _kv(candidate, read_text(text) if spec.bits else None, spec, as_json)
    elif isinstance(spec, SweepSpec):
        bound_heap_growth()  # a sweep converts one checkpoint after another
        _sweep(candidate, read_text(text), spec, as_json)
    else:
        _compare(candidate, read_text(text), spec, as_json)


def _compare(candidate: str, text: Text, spec: CompareSpec, as_json: bool) -> None:
    from tq_cli.demo_model import photographs_folder
    from tq_cli.evaluation.compare import run_compare

    with progress_bar() as bar:
        task = bar.add_task("windows", total=None)
        result = run_compare(candidate, text, spec, progress=lambda done, total: bar.update(
            task, completed=done, total=total), photographs=photographs_folder)
    if as_json:
        emit_json(result)
    else:
        stdout.print(result_table(result))


def _sweep(source: str, text: Text, spec: SweepSpec, as_json: bool) -> None:
    from tq_cli.evaluation.sweep import evaluate_sweep

    with progress_bar() as bar:
        task = bar.add_task("combinations", total=len(spec.combinations()))
        result = evaluate_sweep(source, text, spec, on_row=lambda row, done, total: bar.update(
            task, completed=done))
    if as_json:
        emit_json(result)
    else:
        stdout.print(sweep_table(result["rows"]))


def _kv(candidate: str, text: Text | None, spec: KVEvalSpec, as_json: bool) -> None:
    from tq_cli.evaluation.kv import evaluate_kv

    with progress_bar() as bar:
        task = bar.add_task("kv cache", total=None)
        result = evaluate_kv(candidate, text, spec, progress=lambda done, total: bar.update(
            task, completed=done, total=total))
    if as_json:
        emit_json(result)
    else:
        stdout.print(kv_table(result))


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
    elif r["kind"] == "image-text":
        rows = [("image cosine mean", f"{m['image_cosine_mean']:.5f}"),
                ("image cosine min", f"{m['image_cosine_min']:.5f}"),
                ("text cosine mean", f"{m['text_cosine_mean']:.5f}"),
                ("text cosine min", f"{m['text_cosine_min']:.5f}"),
                ("zero-shot agreement", f"{m['zero_shot_agreement']:.4f}"),
                ("reference top-1 accuracy", _fraction(m["reference_top1_accuracy"])),
                ("candidate top-1 accuracy", _fraction(m["candidate_top1_accuracy"])),
                ("photographs / captions", f"{m['photographs']} / {m['captions']}")]
    else:
        rows = [("cosine mean", f"{m['cosine_mean']:.5f}"),
                ("cosine min", f"{m['cosine_min']:.5f}"),
                ("similarity Spearman", f"{m['similarity_spearman']:.5f}"),
                ("sentences", str(m["sentences"]))]
    if "model_bits_per_weight" in r:
        rows.insert(0, ("bits per weight (whole model)", f"{r['model_bits_per_weight']:.4f}"))
    if "bits_per_weight" in r:
        rows.insert(0, ("bits per weight (converted)", f"{r['bits_per_weight']:.4f}"))
    s = r["settings"]
    source = ("images", s["images"]) if "images" in s else ("text", s["text_source"])
    rows.append(("settings", ", ".join(f"{k}={v}" for k, v in s.items()
                                       if k not in ("text_source", "images"))))
    rows.append(source)
    for k, v in rows:
        t.add_row(k, v)
    return t


def _fraction(x: float | None) -> str:
    return "n/a (no labels)" if x is None else f"{x:.4f}"


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

def kv_table(r: dict[str, Any]) -> Table:
    m, s = r["metrics"], r["settings"]
    needle = r.get("needle") or {}
    t = Table(title=f"tq eval --kv-bits: {r['candidate']}")
    for c in ("cache", "bits/elem", "vs bf16", "ppl", "ppl change", "KL", "top-1", "K err",
              "V err", "forward s"):
        t.add_column(c, justify="left" if c == "cache" else "right")
    if needle:
        t.add_column("passkey", justify="right")

    def found(label: str) -> list[str]:
        if not needle:
            return []
        n = needle[label]
        per = ", ".join(f"{k}: {v['found']}/{v['total']}" for k, v in n["by_length"].items())
        return [per]

    def err(x: float | None) -> str:
        return "" if x is None else f"{x:.4f}"

    if m is None:  # --needle alone
        t.add_row("full precision", "16", "1.00", "", "", "", "", "", "", "", *found("full"))
        return t
    t.add_row("full precision", "16", "1.00", f"{m['reference_perplexity']:.4f}", "",
              "", "", "", "", f"{m['reference_forward_seconds']:.1f}", *found("full"))
    for row in m["rows"]:
        t.add_row(row["label"], f"{row['bits_per_element']:.3f}",
                  f"{16 / row['bits_per_element']:.2f}", f"{row['perplexity']:.4f}",
                  f"{row['perplexity_change']:+.2%}", f"{row['kl_mean']:.5f}",
                  f"{row['top1_agreement']:.4f}", err(row.get("key_rel_error")),
                  err(row.get("value_rel_error")), f"{row['forward_seconds']:.1f}",
                  *found(row["label"]))
    t.caption = (f"context {s['context']} (prefill {s['prefill']}, chunks of {s['chunk']}), "
                 f"{m['windows']} windows, {m['scored_tokens']} scored tokens; bits/elem at "
                 "that context, full-precision parts counted at 16 bits; K/V err: relative "
                 "squared error of the coded tokens")
    return t
