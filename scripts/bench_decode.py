"""CPU decode and prefill speed, and resident memory, of a converted SmolLM2 against fp32.

Usage: python scripts/bench_decode.py [TQ_FOLDER] [--tokens 64] [--prefill 512]
                                      [--threads 1,2] [--rounds 3] [--gemm bf16,fp32]
                                      [--json FILE]

Without TQ_FOLDER it converts SmolLM2-135M at 4 bits into a temporary folder first.
Both models are loaded side by side and timed in alternation, for each thread count:
greedy decode of exactly --tokens new tokens from the same prompt (tokens/s; EOS off, see
`exactly`), and one forward
over --prefill tokens of the evaluation text (tokens/s); the best of --rounds each, so a
burst of load from elsewhere does not decide the ratio. The converted model's prefill is
timed once per CPU GEMM product precision in --gemm (`tq_kernels.cpu.set_gemm_precision`;
the first is the default "tq_prefill"), all in the same rounds. The converted model decodes
twice: eagerly (`tq_cli.load(..., compile=False)`) and with the compiled decode step and
static cache `tq_cli.load` gives generate() by default on the CPU (`runtime.compiled`;
compiled during the warm-up, so the rounds time decoding only), and the greedy tokens of
the two are compared; so is, for a checkpoint that keeps its head as the source has it,
the compiled model with lm_head quantized as it loads (--head-bits,
`tq_cli.load(..., head_bits=8)`; a checkpoint that stores its head quantized, as `tq
convert` does by default, runs it as stored). The converted layers' resident bytes are
compared with the fp16 size of the same layers.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tq_cli
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.demo_model import smollm2_folder
from tq_cli.io.text import evaluation_text
from tq_cli.quant.spec import QuantSpec
from tq_kernels import cpu, isas


def exactly(model: Any, tokens: int) -> Any:
    """The model's generation config, greedy, for exactly `tokens` new tokens: EOS off (an
    EOS is a token like any other), rather than min_new_tokens, whose logits processor
    masks EOS over the whole vocabulary every step (about 0.6 ms a token here, a cost of
    the benchmark, not of decoding)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample = None, False
    config.max_new_tokens, config.min_new_tokens = tokens, None
    return config


def decode(model: Any, ids: torch.Tensor, tokens: int) -> tuple[float, torch.Tensor]:
    config = exactly(model, tokens)
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(ids, generation_config=config)
        return tokens / (time.perf_counter() - t), out


def prefill(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        t = time.perf_counter()
        model(ids, use_cache=False)
        return ids.shape[1] / (time.perf_counter() - t)


def measure(models: dict[str, torch.nn.Module], prompt: torch.Tensor, long: torch.Tensor,
            tokens: int, rounds: int, gemms: list[str]) -> dict[str, Any]:
    """Best-of-rounds decode and prefill tokens/s per model, alternating the models; the
    converted model's prefill once per GEMM product precision."""
    best: dict[str, float] = {}
    outs: dict[str, torch.Tensor] = {}

    def keep(key: str, value: float) -> None:
        best[key] = max(best.get(key, 0.0), value)

    for m in models.values():  # warm-up: first-call allocations, the kernel build
        decode(m, prompt, 2)
        prefill(m, long[:, :32])
    for _ in range(rounds):
        for name, m in models.items():
            tps, outs[name] = decode(m, prompt, tokens)
            keep(f"{name}.decode", tps)
            if name.startswith("tq_compiled"):  # its prefill is the eager model's
                continue
            if name != "tq":
                keep(f"{name}.prefill", prefill(m, long))
                continue
            for gemm in gemms:
                cpu.set_gemm_precision(gemm)
                keep(f"tq.prefill.{gemm}", prefill(m, long))
            cpu.set_gemm_precision(None)
    native = cpu.native_bf16_gemm()  # without bf16 dot products "bf16" runs fp32
    ran = {g: g if native else "fp32" for g in gemms}
    n = prompt.shape[1]
    row: dict[str, Any] = {
        "fp32_decode_tokens_per_s": round(best["fp32.decode"], 2),
        "tq_decode_tokens_per_s": round(best["tq.decode"], 2),
        "decode_ratio_tq_over_fp32": round(best["tq.decode"] / best["fp32.decode"], 3),
        "tq_compiled_decode_tokens_per_s": round(best["tq_compiled.decode"], 2),
        "decode_ratio_tq_compiled_over_fp32": round(
            best["tq_compiled.decode"] / best["fp32.decode"], 3),
        "fp32_prefill_tokens_per_s": round(best["fp32.prefill"], 1),
    }
    for i, gemm in enumerate(gemms):
        tag = "" if i == 0 else f"_{gemm}_products"
        row[f"tq{tag}_prefill_gemm_ran"] = ran[gemm]
        row[f"tq{tag}_prefill_tokens_per_s"] = round(best[f"tq.prefill.{gemm}"], 1)
        row[f"prefill{tag}_ratio_tq_over_fp32"] = round(
            best[f"tq.prefill.{gemm}"] / best["fp32.prefill"], 3)
    row["same_greedy_tokens"] = int((outs["tq"][0, n:] == outs["fp32"][0, n:]).sum())
    same = (outs["tq_compiled"][0, n:] == outs["tq"][0, n:]).long()
    row["compiled_leading_tokens_as_eager"] = int(same.cumprod(0).sum())
    for name in models:
        if name.startswith("tq_compiled_head"):
            row[f"{name}_decode_tokens_per_s"] = round(best[f"{name}.decode"], 2)
            row[f"decode_ratio_{name}_over_fp32"] = round(
                best[f"{name}.decode"] / best["fp32.decode"], 3)
            same = (outs[name][0, n:] == outs["tq"][0, n:]).long()
            row[f"{name}_leading_tokens_as_eager"] = int(same.cumprod(0).sum())
    return row


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gemm", default="bf16,fp32",
                    help="CPU GEMM product precisions to time the prefill with, the first "
                         "reported as tq_prefill (bf16 falls back to fp32 on CPUs without "
                         "bf16 dot products)")
    ap.add_argument("--head-bits", default="8",
                    help="also decode compiled with lm_head quantized at these bits as it "
                         "loads (comma-separated, '' for none)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    gemms = [g.strip() for g in args.gemm.split(",") if g.strip()]
    if not gemms or not set(gemms) <= set(cpu.GEMM_PRECISIONS):
        ap.error(f"--gemm takes {' and/or '.join(cpu.GEMM_PRECISIONS)}, got {args.gemm!r}")
    src = smollm2_folder()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder) if args.folder else Path(tmp) / "smol-tq4"
        if not args.folder:
            convert(src, folder, ConvertSpec(quant=QuantSpec(bits=4)))
        tok = AutoTokenizer.from_pretrained(src)
        prompt = tok("The history of the Python programming language",
                     return_tensors="pt").input_ids
        long = tok(evaluation_text().text, return_tensors="pt").input_ids[:, :args.prefill]
        models = {"fp32": AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(),
                  "tq": tq_cli.load(folder, device="cpu", compile=False),
                  "tq_compiled": tq_cli.load(folder, device="cpu", compile=True)}
        config = json.loads((folder / "config.json").read_text())["quantization_config"]
        stored_head = config.get("head_bits")  # the checkpoint's own head (tq convert)
        for hb in (int(b) for b in args.head_bits.split(",") if b.strip() and not stored_head):
            models[f"tq_compiled_head{hb}"] = tq_cli.load(folder, device="cpu", compile=True,
                                                          head_bits=hb)
        rep = models["tq"].tq_report
        runs = []
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            runs.append({"threads": threads, **measure(models, prompt, long, args.tokens,
                                                       args.rounds, gemms)})
        _, out = decode(models["tq"], prompt, args.tokens)
    n = prompt.shape[1]
    row = {
        "model": "SmolLM2-135M-Instruct", "tq_folder": str(folder), "new_tokens": args.tokens,
        "prefill_tokens": long.shape[1], "cpu_count": os.cpu_count(), "runs": runs,
        "stored_head_bits": stored_head,
        "converted_layers": rep["layers"], "backends": dict(rep["backends"]),
        "cpu_gemm_default": rep["cpu_gemm"],
        "tq_bytes": rep["tq_bytes"], "packed_bytes": rep["packed_bytes"],
        "rotation_bytes": rep["rotation_bytes"], "fp16_bytes_same_layers": rep["fp16_bytes"],
        "memory_ratio_tq_over_fp16": round(rep["tq_bytes"] / rep["fp16_bytes"], 4),
        "tq_text": tok.decode(out[0, n:]), **isas.describe(),
    }
    print(json.dumps(row, indent=2))
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
