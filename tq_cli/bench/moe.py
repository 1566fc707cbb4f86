"""A mixture-of-experts layer: tq's quantized experts against transformers' own.

One routed-experts layer of OLMoE-1B-7B's shape (hidden 2048, expert intermediate 1024,
64 experts, top-8; `--quick`: 16 experts of 1024 x 512, top-4), timed at batch 1 (a
decode step: 8 experts' weights read) and at a 512-token prefill (every expert hit).
tq's side is `TQExperts` (tq_cli.runtime.experts) over 4-bit TQLinear layers; the
other side is transformers' `MixtralExperts` (the module OLMoE, Qwen-MoE and DeepSeek-V3
share) with fused float32 weights run as `from_pretrained` runs it (`grouped_mm`), the
same in bfloat16 with bfloat16 activations, and float32 through the eager per-expert
loop. The routing is the same random top-k for all four.

The codes, scales and codebook are random, as in the kernels section: the time does not
depend on the values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tq_cli.bench.kernels import GROUP, _operands, time_us
from tq_cli.bench.metrics import Metric
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import RotationSpec
from tq_cli.runtime.tq_linear import RotationMaterial, TQLinear

FULL = {"hidden": 2048, "inter": 1024, "experts": 64, "top_k": 8}  # OLMoE-1B-7B
QUICK = {"hidden": 1024, "inter": 512, "experts": 16, "top_k": 4}
BATCHES = (1, 512)


def _tq_layer(out_f: int, in_f: int, bits: int, gen: torch.Generator) -> TQLinear:
    ops = _operands(out_f, in_f, bits, torch.device("cpu"), gen)
    specs = {k: (tuple(t.shape), t.dtype) for k, t in ops.items()}
    layer = TQLinear(in_f, out_f, bits=bits, group_size=GROUP, specs=specs)
    for k, t in ops.items():
        setattr(layer.weight, k, t)
    rot = make_rotation(RotationSpec(kind="hadamard"), in_f, GROUP)
    material = RotationMaterial("hadamard", GROUP, {})
    assert rot.signs is not None
    material.signs = rot.signs
    layer.set_rotation(material)
    return layer


def build(shape: dict[str, int], bits: int, gen: torch.Generator) -> tuple[nn.Module, Any]:
    """(tq's experts, transformers' MixtralExperts in float32) of one shape."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from tq_cli.runtime.experts import TQExperts

    cfg = MixtralConfig(hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                        num_local_experts=shape["experts"])
    # what from_pretrained picks in transformers 5.25 (torch._grouped_mm); "eager", the
    # per-expert loop, is timed beside it
    cfg._experts_implementation = "grouped_mm"
    fp: Any = MixtralExperts(cfg)
    h, i = shape["hidden"], shape["inter"]
    with torch.no_grad():
        fp.gate_up_proj.copy_(torch.randn(fp.gate_up_proj.shape, generator=gen) * 0.02)
        fp.down_proj.copy_(torch.randn(fp.down_proj.shape, generator=gen) * 0.02)
    layers = {}
    for e in range(shape["experts"]):
        for role, (out_f, in_f) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            layers[(e, role)] = (f"{e}.{role}", _tq_layer(out_f, in_f, bits, gen))
    return TQExperts(fp, layers), fp


@torch.no_grad()
def _time(layers: list[nn.Module], x: torch.Tensor, index: torch.Tensor,
          weights: torch.Tensor, device: torch.device) -> list[float]:
    """Microseconds of tq, float32 (grouped_mm), bfloat16 (grouped_mm, its activations and
    weights in bf16) and float32 through the eager loop."""
    tq, fp, bf16, eager = layers
    xb, wb = x.to(torch.bfloat16), weights.to(torch.bfloat16)
    return time_us([lambda: tq(x, index, weights), lambda: fp(x, index, weights),
                    lambda: bf16(xb, index, wb), lambda: eager(x, index, weights)], device)


def run(device: torch.device, quick: bool, bits: int = 4,
        progress: Callable[[str], None] | None = None,
        ) -> tuple[list[dict[str, Any]], dict[str, Metric]]:
    if device.type != "cpu":
        return [], {}  # the CUDA MoE path is TQLinear's Triton kernel, timed in kernels
    shape = QUICK if quick else FULL
    gen = torch.Generator().manual_seed(0)
    if progress:
        progress(f"moe: building {shape['experts']} experts")
    tq, fp = build(shape, bits, gen)
    bf16 = type(fp)(fp.config).to(torch.bfloat16)
    eager_cfg = type(fp.config)(**fp.config.to_dict())
    eager_cfg._experts_implementation = "eager"
    eager = type(fp)(eager_cfg)
    with torch.no_grad():
        for m in (bf16, eager):
            m.gate_up_proj.copy_(fp.gate_up_proj)
            m.down_proj.copy_(fp.down_proj)
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Metric] = {}
    for batch in BATCHES:
        if progress:
            progress(f"moe: batch {batch}")
        x = torch.randn(batch, shape["hidden"], generator=gen)
        scores = torch.randn(batch, shape["experts"], generator=gen)
        weights, index = scores.softmax(-1).topk(shape["top_k"], dim=-1)
        t_tq, t_fp, t_bf16, t_eager = _time([tq, fp, bf16, eager], x, index, weights, device)
        tag = "decode" if batch == 1 else f"prefill{batch}"
        ratios = {"tq_over_fp32": t_tq / t_fp, "tq_over_bf16": t_tq / t_bf16,
                  "tq_over_fp32_eager": t_tq / t_eager}
        rows.append({"layer": f"{shape['experts']}x({shape['hidden']}x{shape['inter']}) "
                              f"top-{shape['top_k']}", "batch": batch, "bits": bits,
                     "tq_us": t_tq, "fp32_us": t_fp, "bf16_us": t_bf16,
                     "fp32_eager_us": t_eager} | ratios)
        for col, value in ratios.items():
            metrics[f"moe.{device.type}.{tag}.{bits}bit.{col}"] = Metric(value, "info")
    return rows, metrics
