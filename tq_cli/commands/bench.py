"""`tq bench`: measure quality per bit, kernels and conversion; gate against a baseline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tq_cli.commands._common import emit_json, fail, stderr, usage

# Tables are wide; a log file or pipe gets them whole instead of at 80 columns.
stdout = Console(width=None if Console().is_terminal else 140)

HELP = "Benchmark quality per bit, kernels and conversion; gate regressions against a baseline."
EPILOG = """Sections: quality (reconstruction error of fixed-seed matrices at 2, 3, 4 bits per
rotation: deterministic, gated by --max-regression), kernels (tq matmul and rotation
against torch.nn.functional.linear in the same run) and conversion (tq convert --fast against a
plain safetensors read+write of the same synthetic model, and its peak RSS). Timings are
compared as ratios from the same run, gated by --max-slowdown, and only against a
baseline from the same kind of device. kv (only with --section kv): KV cache bytes per
token against bf16 at 2k/8k/32k and its decode time per token against a full-precision
cache. moe (only with --section moe): one mixture-of-experts layer (OLMoE's shape) with
4-bit experts against transformers' experts module in float32 and bfloat16, at a decode
step and a 512-token prefill.

Exit codes: 0 ok, 1 error, 2 usage error, 3 a metric regressed beyond its limit.

Examples:

  tq bench --quick --baseline .ci/bench-baseline-cpu.json  (what CI runs)

  tq bench --json result.json                              (full run; a new baseline)
"""

REGRESSED = 3


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


HEADERS = {
    "group_size": "group", "rel_error": "rel. error", "bits_per_weight": "bits/w",
    "tq_matmul_us": "tq µs", "tq_rotate_us": "rot µs", "tq_layer_us": "layer µs",
    "torch_linear_us": "torch µs", "torch_bf16_us": "bf16 µs",
    "matmul_over_torch": "tq/torch", "with_rotation_over_torch": "layer/torch",
    "matmul_over_bf16": "tq/bf16", "tq_layer_bf16_us": "bf16 layer µs",
    "bf16_layer_over_bf16": "bf16 layer/bf16",
    "tq_gb_s": "tq GB/s", "torch_gb_s": "torch GB/s", "tq_bandwidth_fraction": "of bw",
    "source_mb": "MB", "convert_s": "convert s", "copy_s": "copy s",
    "convert_over_copy": "convert/copy", "convert_mb_s": "MB/s", "peak_rss_mb": "peak RSS MB",
    "check_s": "of which check s",
}
TEXT_COLUMNS = ("matrix", "method", "rotation", "shape", "model", "backend", "cache", "path")


def _table(title: str, rows: list[dict[str, Any]], cols: list[str],
           caption: str | None = None) -> Table:
    table = Table(title=title, caption=caption)
    for c in cols:
        table.add_column(HEADERS.get(c, c), no_wrap=True,
                         justify="left" if c in TEXT_COLUMNS else "right")
    for r in rows:
        table.add_row(*(_fmt(r.get(c, "")) for c in cols))
    return table


def print_tables(result: dict[str, Any]) -> None:
    s = result["sections"]
    if "quality" in s:
        stdout.print(_table("Quality per bit (relative reconstruction error, lower is better)",
                            s["quality"], ["matrix", "method", "rotation", "bits",
                                           "group_size", "rel_error", "bits_per_weight"],
                            "512x1536 fixed-seed matrices; bits/w charges the rotation "
                            "material to this one matrix (a model shares it per width)"))
    if s.get("kernels"):
        k0 = s["kernels"][0]
        cols = ["shape", "bits", "batch", "path", "tq_matmul_us", "tq_rotate_us", "tq_layer_us",
                "torch_linear_us", "torch_bf16_us", "matmul_over_torch",
                "with_rotation_over_torch", "matmul_over_bf16", "tq_layer_bf16_us",
                "bf16_layer_over_bf16", "tq_gb_s"]
        caption = ("fastest of up to 50 runs on CPU, median of CUDA graph replays on CUDA; "
                   "random codes, 0.1% outliers; layer = rotation + matmul + "
                   "outliers; GB/s of weight bytes read")
        if "tq_bandwidth_fraction" in k0:
            cols.append("tq_bandwidth_fraction")
            caption += f"; of bw: tq GB/s over {k0.get('memory_gb_s', 0):.1f} GB/s"
        stdout.print(_table(f"Kernels: {k0['backend']} vs F.linear {k0['torch_dtype']} and "
                            "bfloat16", s["kernels"], cols, caption))
    if "conversion" in s:
        stdout.print(_table("Conversion vs safetensors load_file+save_file", s["conversion"],
                            ["model", "source_mb", "convert_s", "check_s", "copy_s",
                             "convert_over_copy", "convert_mb_s", "peak_rss_mb",
                             "bits_per_weight"]))
    if s.get("kv"):
        print_kv_tables(s["kv"])
    if s.get("moe"):
        stdout.print(_table("Mixture-of-experts layer: tq experts vs transformers' experts "
                            "module", s["moe"], ["layer", "batch", "bits", "tq_us", "fp32_us",
                                                 "bf16_us", "fp32_eager_us", "tq_over_fp32",
                                                 "tq_over_bf16", "tq_over_fp32_eager"],
                            "fastest of up to 50 runs; same random routing on all three"))
    env = result["environment"]
    stdout.print(f"{result['mode']} run in {result['seconds']:.1f} s on {env['device_name']} "
                 f"({env['device_type']}, {env['cpu_count']} CPUs"
                 f"{', tq CPU kernels ' + env['cpu_isa'] if env.get('cpu_isa') else ''}, "
                 f"torch {env['torch']}, "
                 f"triton {env['triton']}, CUDA {env['cuda']})", highlight=False)


def print_kv_tables(rows: list[dict[str, Any]]) -> None:
    mem = [r for r in rows if r["table"] == "memory"]
    dec = [r for r in rows if r["table"] == "decode"]
    stdout.print(_table("KV cache memory per token (SmolLM2-135M shapes, 128-token window)",
                        mem, ["context", "bits", "key_bits", "value_bits", "bytes_per_token",
                              "bf16_bytes_per_token", "vs_bf16", "bits_per_element"],
                        "codes + fp16 norms + the window at 16 bits + channel orders + "
                        "shared rotations"))
    stdout.print(_table("KV cache decode time per token (random SmolLM2-shaped model)", dec,
                        ["context", "layers", "cache", "ms_per_token", "vs_dynamic",
                         "cache_gb_s", "copy_gb_s"],
                        "medians; time against transformers' DynamicCache in the same run; "
                        "cache bytes read per step over the step's time, and the machine's "
                        "copy rate"))


def _read_baseline(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise fail(f"{path}: no such baseline; write one with tq bench --json {path}") from None
    except IsADirectoryError:
        raise fail(f"{path}: is a folder, not a baseline; pass the JSON file tq bench --json "
                   "wrote") from None
    except OSError as e:
        raise fail(f"{path}: cannot read the baseline ({e.strerror})") from None
    except (ValueError, RecursionError):
        raise fail(f"{path}: not a tq bench JSON result; regenerate it with "
                   f"tq bench --json {path}") from None
    if not isinstance(data, dict) or "metrics" not in data:
        raise fail(f"{path}: not a tq bench JSON result (no 'metrics'); regenerate it with "
                   f"tq bench --json {path}")
    from tq_cli.bench.metrics import check_baseline

    check_baseline(data, str(path))  # before the run, not after it
    return data


def main(
    quick: bool = typer.Option(False, "--quick", help="CI-sized run (under 2 minutes on "
                                                     "2 CPU cores)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the result as JSON to "
                                         "FILE ('-' for stdout); it can be the next baseline."),
    baseline: Path | None = typer.Option(None, "--baseline", help="Compare with this JSON "
                                         "result; exit 3 naming each regressed metric."),
    max_regression: float = typer.Option(0.01, "--max-regression", min=0.0,
                                         help="Allowed fractional worsening of a quality "
                                              "metric."),
    max_slowdown: float = typer.Option(0.5, "--max-slowdown", min=0.0,
                                       help="Allowed fractional worsening of a timing ratio "
                                            "or of peak memory."),
    section: list[str] = typer.Option([], "--section", help="quality | kernels | conversion | kv | "
                                      "moe (repeatable; default the first three)."),
    scratch: Path | None = typer.Option(None, "--scratch", help="Folder for the synthetic "
                                        "model (kept between runs); default a temp folder."),
) -> None:
    from tq_cli.bench.run import OPTIONAL_SECTIONS, SECTIONS, BenchSpec, run_bench
    from tq_cli.device import check_device, resolve_device

    try:
        check_device(device)
    except ValueError as e:
        raise usage(f"--device: {e}") from None
    bad = [s for s in section if s not in SECTIONS + OPTIONAL_SECTIONS]
    if bad:
        raise usage(f"--section: '{bad[0]}' is not one of "
                    f"{', '.join(SECTIONS + OPTIONAL_SECTIONS)}")
    base = _read_baseline(baseline) if baseline is not None else None
    dev = resolve_device(device)
    spec = BenchSpec(quick=quick, device=dev, sections=tuple(section) or SECTIONS,
                     scratch=scratch)
    with stderr.status("benchmark") as status:
        result = run_bench(spec, progress=lambda msg: status.update(msg))
    if base is not None:
        result.gate(base, max_regression, max_slowdown)
    data = result.to_dict()
    if json_out is not None and str(json_out) == "-":
        emit_json(data)
    else:
        print_tables(data)
        if json_out is not None:
            json_out.write_text(json.dumps(data, indent=2) + "\n")
    cmp = result.comparison
    if cmp is None:
        return
    where = f"against {baseline}: {cmp.compared} metrics compared"
    if cmp.skipped:
        where += f", {len(cmp.skipped)} skipped ({cmp.skipped[0]}"
        where += ", ...)" if len(cmp.skipped) > 1 else ")"
    if cmp.regressions:
        for r in cmp.regressions:
            stderr.print(f"[bold red]regression:[/] {escape(r.describe())}", highlight=False,
                         soft_wrap=True)
        stderr.print(f"{len(cmp.regressions)} regressed {where}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=REGRESSED)
    stderr.print(f"no regression {where}", highlight=False, soft_wrap=True)
