"""CPU decode speed and resident memory of a converted SmolLM2 against its fp32 original.

Usage: python scripts/bench_decode.py [TQ_FOLDER] [--tokens 64] [--json FILE]

Without TQ_FOLDER it converts SmolLM2-135M at 4 bits into a temporary folder first.
Both models decode greedily from the same prompt, in the same run; the converted
layers' resident bytes are compared with the fp16 size of the same layers.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import tq_cli
from tq_cli.converter import ConvertSpec, convert
from tq_cli.spec import QuantSpec
from tq_cli.testmodels import smollm2_folder


def decode(model: torch.nn.Module, ids: torch.Tensor, tokens: int) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return tokens / (time.perf_counter() - t), out


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    src = smollm2_folder()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder) if args.folder else Path(tmp) / "smol-tq4"
        if not args.folder:
            convert(src, folder, ConvertSpec(quant=QuantSpec(bits=4)))
        tok = AutoTokenizer.from_pretrained(src)
        ids = tok("The history of the Python programming language", return_tensors="pt").input_ids
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        ref_tps, ref_out = decode(ref, ids, args.tokens)
        del ref
        model = tq_cli.load(folder, device="cpu")
        tq_tps, tq_out = decode(model, ids, args.tokens)
        rep = model.tq_report
    n = ids.shape[1]
    row = {
        "model": "SmolLM2-135M-Instruct", "tq_folder": str(folder), "new_tokens": args.tokens,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "fp32_tokens_per_s": round(ref_tps, 2), "tq_tokens_per_s": round(tq_tps, 2),
        "speed_ratio_tq_over_fp32": round(tq_tps / ref_tps, 3),
        "converted_layers": rep["layers"], "backends": dict(rep["backends"]),
        "tq_bytes": rep["tq_bytes"], "packed_bytes": rep["packed_bytes"],
        "rotation_bytes": rep["rotation_bytes"], "fp16_bytes_same_layers": rep["fp16_bytes"],
        "memory_ratio_tq_over_fp16": round(rep["tq_bytes"] / rep["fp16_bytes"], 4),
        "same_greedy_tokens": int((tq_out[0, n:] == ref_out[0, n:]).sum()),
        "tq_text": tok.decode(tq_out[0, n:]),
    }
    print(json.dumps(row, indent=2))
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
