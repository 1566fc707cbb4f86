"""The model card (README.md) written into every converted folder."""

from __future__ import annotations

import json


def render_card(manifest: dict) -> str:
    s = manifest["summary"]
    q, r = manifest["quant"], manifest["rotation"]
    src = manifest["source"]
    head = f"{s['head_bits']}-bit" if s.get("head_bits") else "not quantized"
    lines = [
        "---",
        "tags: [turboquant, tq, quantized]",
        "---",
        f"# {src.get('name', 'model')} — TurboQuant {q['bits']}-bit",
        "",
        f"Converted with tq {manifest['tq_version']} (format v{manifest['format_version']}) "
        f"from `{src.get('path')}` (fingerprint `{src['fingerprint'][:23]}…`).",
        "",
        "| setting | value |",
        "|---|---|",
        f"| bits | {q['bits']} |",
        f"| group size | {q['group_size']} |",
        f"| codebook | {q['codebook']} |",
        f"| rotation | {r['kind']} (block {r.get('block') or q['group_size']}, seed {r['seed']}) |",
        f"| outliers | {q['outliers']:.4%} |",
        f"| recipe | {manifest['recipe']['name']} |",
        "",
        "| result | value |",
        "|---|---|",
        f"| tensors converted / kept | {s['tensors_converted']} / {s['tensors_kept']} |",
        f"| bits per weight (converted tensors) | {s['bits_per_weight']:.4f} |",
        *([f"| bits per weight (whole model) | {s['model_bits_per_weight']:.4f} |"]
          if "model_bits_per_weight" in s else []),
        f"| lm_head | {head} |",
        f"| mean relative reconstruction error | {s['mean_rel_error']:.6f} |",
        f"| checkpoint size | {s['output_bytes'] / 1e6:.1f} MB "
        f"(source {s['source_bytes'] / 1e6:.1f} MB) |",
        "",
        "Load it with `tq_cli.load(path)`, or with transformers' `from_pretrained` after "
        "`import tq_cli` (pip install tq); without tq, transformers refuses this folder with "
        "a size mismatch rather than run it. Bits per weight count codes, scales, "
        "codebooks, outliers and rotation material.",
    ]
    evals = manifest.get("eval")
    if evals:
        lines += ["", "## Evaluation", "", "```json", json.dumps(evals, indent=2), "```"]
    return "\n".join(lines) + "\n"
