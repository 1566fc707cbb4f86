"""GPTQ baseline from an external tool: llmcompressor's GPTQModifier, written out dequantized.

Usage (in a venv of its own, not the project's; see below):
    python scripts/gptq_external.py SOURCE OUT [--bits 4] [--group-size 128]
        [--samples 128] [--seqlen 512] [--asym]

Tool: llmcompressor 0.14.0.1 (vLLM project) with compressed-tensors 0.19.0, torch 2.13.0+cpu,
transformers 5.17.0 (llmcompressor pins transformers <=5.17). It runs on CPU: the sequential
pipeline calibrates one decoder layer at a time, feeding each layer the outputs of the
already-quantized layers before it, as in the GPTQ paper. Venv:
    python3 -m venv /tmp/gptqvenv
    /tmp/gptqvenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1

Settings: every nn.Linear except lm_head (SmolLM2 ties it to the embedding, which stays
fp32), int `bits`, groups of `group-size` input columns, symmetric by default (the tool's
W4A16 preset; --asym for asymmetric), min-max observer, scales fixed from the original
weights before the GPTQ sweep (llmcompressor's way), desc_act/actorder off, block 128,
dampening 0.01 of the mean Hessian diagonal. Calibration: the project's calibration text
(tq_cli.io.text.calibration_text, read in a subprocess so tq's transformers hook stays out of
this process) tokenized once and cut into `samples` consecutive chunks of `seqlen` tokens;
with SmolLM2's tokenizer it is 50,079 tokens, so at most 97 x 512 (or 130 x 384).

Dequantization: llmcompressor writes the GPTQ result back into each Linear's `weight` as
fake-quantized values, (q - zero) * scale in fp32, next to `weight_scale` and
`weight_zero_point`. The script checks that every such weight lies on its grid, then
saves, under the source's own tensor names, exactly the tensors the source has (fp32), with
config.json and the tokenizer files copied from SOURCE: an ordinary model folder that
`AutoModelForCausalLM.from_pretrained` loads and `tq eval OUT --reference SOURCE` measures.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def calibration_ids(tok, samples: int, seqlen: int) -> list[list[int]]:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tq_cli.io.text import "
            "calibration_text; sys.stdout.write(calibration_text().text)")
    text = subprocess.run([sys.executable, "-c", code, str(ROOT)], check=True,
                          capture_output=True, text=True).stdout
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = min(samples, len(ids) // seqlen)
    if n < samples:
        print(f"calibration text has {len(ids)} tokens: {n} samples of {seqlen}, not {samples}")
    return [ids[i * seqlen:(i + 1) * seqlen] for i in range(n)]


def pad_partial_groups() -> None:
    """Let the weight observer see a last group narrower than group-size (SmolLM2's 576 =
    4.5 x 128 columns): it reshapes columns into whole groups, so pad them by repeating
    the last column, which leaves every group's min and max as those of its real columns.
    GPTQ itself already maps column j to group j // group-size with ceil(cols/gs) scales."""
    import llmcompressor.observers.helpers as h
    from compressed_tensors.quantization import QuantizationStrategy

    original = h._flatten_weight

    def flatten(value, args):
        pad = -value.shape[-1] % (args.group_size or 1)
        if pad and args.strategy == QuantizationStrategy.GROUP:
            value = torch.nn.functional.pad(value, (0, pad), mode="replicate")
        return original(value, args)

    h._flatten_weight = flatten


def check_on_grid(model, bits: int, group: int) -> float:
    """Largest |w - (round(w/s)+z clamped - z)*s| / s over all quantized weights."""
    worst = 0.0
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1  # signed codes, asym included
    for _name, m in model.named_modules():
        if not hasattr(m, "weight_scale"):
            continue
        w, s = m.weight.detach().float(), m.weight_scale.detach().float()
        z = m.weight_zero_point.detach().float()
        se = s.repeat_interleave(group, 1)[:, :w.shape[1]]
        ze = z.repeat_interleave(group, 1)[:, :w.shape[1]]
        q = torch.clamp(torch.round(w / se) + ze, lo, hi)
        worst = max(worst, ((w - (q - ze) * se).abs() / se).max().item())
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--asym", action="store_true", help="asymmetric grid (default: symmetric)")
    args = ap.parse_args()

    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.source)
    chunks = calibration_ids(tok, args.samples, args.seqlen)
    ds = Dataset.from_dict({"input_ids": chunks,
                            "attention_mask": [[1] * args.seqlen for _ in chunks]})
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=args.bits, type="int", symmetric=not args.asym,
                               strategy="group", group_size=args.group_size, actorder=None)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"],
                          actorder=None, block_size=128, dampening_frac=0.01,
                          bypass_divisibility_checks=True)  # see pad_partial_groups
    pad_partial_groups()
    t0 = time.time()
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(chunks),
            max_seq_length=args.seqlen, shuffle_calibration_samples=False,
            pipeline="sequential")
    print(f"GPTQ took {time.time() - t0:.1f} s on {len(chunks)} x {args.seqlen} tokens")

    off = check_on_grid(model, args.bits, args.group_size)
    print(f"largest distance of a weight from its grid: {off:.2e} steps")
    if off > 1e-3:
        raise SystemExit("weights are not on their quantization grid; not saving")

    sd = model.state_dict()
    out = {}
    for f in sorted(args.source.glob("*.safetensors")):
        with safe_open(f, "pt") as src:
            for name in src.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[name] = sd[name].detach().to(torch.float32).contiguous().clone()
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(out, args.out / "model.safetensors", metadata={"format": "pt"})
    for f in args.source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy2(f, args.out / f.name)
    print(f"wrote {len(out)} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
