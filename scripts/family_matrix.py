"""The family matrix in numbers: each tiny model of tests/families.py converted at 4 bits
(group 32), loaded with tq_cli.load, run against its original, dequantized, and loaded by
transformers with output_loading_info. Prints a Markdown table (docs/results.md).

    python scripts/family_matrix.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from families import FAMILIES

import tq_cli
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.quant.spec import QuantSpec
from tq_kernels import cpu


def _output(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    if hasattr(out, "image_embeds"):
        return torch.cat([out.image_embeds.flatten(), out.text_embeds.flatten()])
    return out.logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    warnings.filterwarnings("ignore")
    cpu.set_gemm_precision("fp32")  # the dequantized twin multiplies in float32 too
    print("| family | converted | kept | quantized share (non-embedding) | "
          "logits rel. error to the original | dequantized twin vs tq | "
          "output_loading_info clean | self-check (worst block) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, build in FAMILIES.items():
        torch.manual_seed(0)
        model, inputs = build()
        folder = Path(tempfile.mkdtemp(prefix=f"tq-family-{name}-"))
        model.save_pretrained(folder / "src")
        result = convert(folder / "src", folder / "tq",
                         ConvertSpec(quant=QuantSpec(bits=4, group_size=32), device="cpu"))
        manifest = json.loads((folder / "tq" / "tq_manifest.json").read_text())
        kept = sum(1 for e in manifest["tensors"] if "kept_because" in e)
        tq = tq_cli.load(folder / "tq", device="cpu")
        y, y_ref = _output(tq, inputs), _output(model.eval(), inputs)
        _, info = type(tq).from_pretrained(folder / "tq", output_loading_info=True)
        twin = _rel(_output(tq.dequantize(), inputs), y)
        check = result.self_check or {}
        worst = (f"{max(v for k, v in check['rel_errors'].items() if k != 'head'):.3f}"
                 if check.get("ran") else "not run")
        print(f"| {name} | {result.tensors_converted} | {kept} | "
              f"{result.quantized_share[1]:.0%} | {_rel(y, y_ref):.3f} | "
              f"{twin:.1e} | {not any(info.values())} | {worst} |")


if __name__ == "__main__":
    main()
