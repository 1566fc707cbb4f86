"""llama.cpp beside tq on the same weights: CPU decode, prefill, memory, size.

Usage: python scripts/bench_llamacpp.py [--shape smollm2|qwen2.5-0.5b] [--bits 4,3]
           [--quants F32,Q4_0,Q4_K_M,Q3_K_S] [--tq-folder TQ] [--tokens 64] [--prefill 512]
           [--threads 1,2] [--rounds 3] [--json FILE] [--llama-python PATH] [--work DIR]

Shapes: SmolLM2-135M-Instruct (the real model), or Qwen2.5-0.5B's shape (hidden 896,
intermediate 4864, 24 layers, 14/2 heads of 64, its 151,936-entry tied vocabulary) with
random weights, in float32, as a Llama-architecture folder (no q/k/v bias) with SmolLM2's
tokenizer, built in --work (`tq_cli.bench.synthetic_llama`); its tq conversions are
`--fast` (the weight-only fit: random weights need no calibration, and the kernels that run
are the same).

Engines: tq at each of --bits (`tq_cli.load`, its defaults: on the CPU the compiled decode
step, compiled during the warm-up; `TQ_COMPILE=0` in the environment for the eager path;
the head as the checkpoint stores it: `tq convert` stores it at 8 bits by default, as
llama.cpp's 4-bit files store the tied embedding/head in Q8_0), for a checkpoint that keeps
its head also the same with lm_head quantized to 8 bits as it loads (`head_bits=8`), the
fp32 model in transformers, and llama.cpp (via llama-cpp-python) on GGUFs of the same fp32
folder: F32 (convert_hf_to_gguf.py) and the --quants types made by llama.cpp's quantizer
(without an importance matrix; where a row's width is not a multiple of 256, as SmolLM2's
576 and Qwen2.5-0.5B's 896, llama.cpp stores a K-quant type's tensors in its fallback, Q4_0
for Q3_K, so its "3-bit" files are mostly 4-bit there: the file sizes say so). Each tq row
is set against the llama.cpp types of its own width (Q4_* against tq 4-bit, Q3_* against tq
3-bit). Per thread count and round each engine runs in a fresh subprocess, so its peak RSS
(VmHWM) is its own, and the engines alternate, so a burst of load from elsewhere does not
decide a ratio. After a warm-up each times greedy decode of --tokens new tokens from the
same prompt ids (tokens/s, prompt forward included, EOS a token like any other: generate()
with EOS off, as bench_decode.py's, or a fixed loop) and one forward over --prefill tokens
of the evaluation text; the best of --rounds is kept. Threads: torch.set_num_threads, or
llama.cpp's n_threads and n_threads_batch; nothing is pinned. Also reported: RSS before the
model loads (after the engine's imports), weight file sizes (MB here are MiB), tq's ratios
to each llama.cpp variant, and how many leading greedy ids (of 32) engines share.

Made in --work (default ~/.cache/tq/llamacpp) when missing, then reused: the GGUFs, the
converter (vendor/llama.cpp of llama-cpp-python's sdist, run by this interpreter with the
sdist's gguf-py), the Qwen2.5-0.5B-shaped folder, and tq's conversions (a 4-bit one unless
--tq-folder). llama.cpp runs under --llama-python (default
~/.cache/tq/llamacpp-venv/bin/python); when that is missing, its venv is made and
llama-cpp-python built from source into it (7-10 minutes on one core), with CMAKE_ARGS
from the environment or else `cmake_args()`. If llama.cpp cannot be built or imported,
one line says why and the exit status is 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CMAKE_ARGS = "-DGGML_BLAS=OFF -DLLAVA_BUILD=OFF"  # CPU build, no llava/mtmd
ISA = {"sse4_2": "SSE42", "avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C",
       "bmi2": "BMI2", "avx_vnni": "AVX_VNNI", "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI",
       "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16"}  # /proc/cpuinfo: ggml
PROMPT = "The history of the Python programming language"  # as bench_decode.py
QUANTS = {"Q4_0": 2, "Q4_K_M": 15, "Q3_K_S": 11, "Q3_K_M": 12}  # llama_ftype (llama.h)
SHAPES = ("smollm2", "qwen2.5-0.5b")
LEAD = 32  # greedy ids compared between engines


def cmake_args() -> str:
    """Native flags, except on a CPU with AMX: there the same instruction sets without AMX,
    since ggml's AMX matmul segfaults (the tile config on its stack is optimized away:
    ggml-org/llama.cpp#20824, PR #26954), taking every Q4_0 and Q4_K_M run down with it."""
    info = Path("/proc/cpuinfo")
    found = re.search(r"^flags\s*:(.*)$", info.read_text(), re.M) if info.exists() else None
    flags = set(found.group(1).split()) if found else set()
    if "amx_int8" not in flags:
        return CMAKE_ARGS
    return " ".join([CMAKE_ARGS, "-DGGML_NATIVE=OFF", *(
        f"-DGGML_{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in ISA.items())])


def fail(msg: str) -> NoReturn:
    print(f"bench_llamacpp: {msg}", file=sys.stderr)
    raise SystemExit(2)


def reason(text: str) -> str:
    """The telling line of a failed run: a traceback's last line, else the first real error
    of a build log (a CMake error with the lines that explain it), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    telling = re.compile(r"CMake Error|error:|Error:|No matching distribution|Could not find"
                         r"|No such file|not found|Errno")
    generic = re.compile(r"subprocess-exited-with-error|^ERROR: (Failed|Could not build)|^note:")
    for i, ln in enumerate(lines if "Traceback (most recent" not in text else []):
        if telling.search(ln) and not generic.search(ln):
            more = lines[i + 1:i + 4] if ln.startswith("CMake Error") else []
            return " ".join([ln, *more])[:300]
    return lines[-1][:300] if lines else "no output"


# ---- workers: one engine, one round, in a subprocess; stdlib imports only at top level ----

def rss_mb(field: str = "VmHWM") -> float:  # VmHWM: peak resident set; VmRSS: now
    status = Path("/proc/self/status").read_text()
    return int(re.search(field + r":\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


Timer = Callable[[list[int], int], tuple[float, list[int]]]  # (ids, new) -> (tokens/s, new ids)


def measure(run: Timer, job: dict[str, Any], base: float) -> dict[str, Any]:
    """Warm-up (first-call allocations, kernel builds), then decode and prefill tokens/s."""
    run(job["prompt"], 2)
    run(job["long"][:32], 0)
    tps, ids = run(job["prompt"], job["tokens"])
    return {"decode": tps, "prefill": run(job["long"], 0)[0], "ids": ids[:LEAD],
            "base_mb": base}


def torch_worker(job: dict[str, Any]) -> dict[str, Any]:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    if job["engine"].startswith("tq"):
        import tq_cli
    torch.set_num_threads(job["threads"])
    base = rss_mb("VmRSS")
    head = 8 if job["engine"] == "tq_head8" else None
    model: Any = (tq_cli.load(job["path"], device="cpu", head_bits=head)
                  if job["engine"].startswith("tq") else
                  AutoModelForCausalLM.from_pretrained(job["path"], dtype=torch.float32).eval())

    def run(ids: list[int], new: int) -> tuple[float, list[int]]:  # as bench_decode.py's
        x = torch.tensor([ids])
        with torch.no_grad():
            t = time.perf_counter()
            if not new:  # prefill: one forward
                model(x, use_cache=False)
                return len(ids) / (time.perf_counter() - t), []
            config = copy.deepcopy(model.generation_config)  # exactly `new` tokens, EOS off
            config.eos_token_id, config.do_sample = None, False
            config.max_new_tokens, config.min_new_tokens = new, None
            out = model.generate(x, generation_config=config)
            return new / (time.perf_counter() - t), out[0, len(ids):].tolist()

    return measure(run, job, base)


def llama_worker(job: dict[str, Any]) -> dict[str, Any]:
    import ctypes

    import llama_cpp
    import numpy as np

    if job["engine"] == "quantize":
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = job["ftype"], job["threads"]
        rc = llama_cpp.llama_model_quantize(job["path"].encode(), job["out"].encode(),
                                            ctypes.byref(params))
        return {"rc": rc}
    base, n_batch = rss_mb("VmRSS"), max(len(job["long"]), 32)
    llm = llama_cpp.Llama(job["path"], n_ctx=max(n_batch, len(job["prompt"]) + job["tokens"])
                          + 8, n_batch=n_batch, n_ubatch=n_batch, n_threads=job["threads"],
                          n_threads_batch=job["threads"], verbose=False)

    def run(ids: list[int], new: int) -> tuple[float, list[int]]:
        out: list[int] = []
        llm.reset()  # and eval() then clears the KV cache
        t = time.perf_counter()
        llm.eval(ids)
        for i in range(new):  # greedy: argmax of the last logits (EOS a token like any other)
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                        shape=(llm.n_vocab(),))
            out.append(int(row.argmax()))
            if i + 1 < new:
                llm.eval(out[-1:])
        return (new or len(ids)) / (time.perf_counter() - t), out

    info = llama_cpp.llama_print_system_info().decode().strip()
    return {**measure(run, job, base), "system_info": info}


def worker() -> int:
    job = json.loads(sys.stdin.read())
    run = llama_worker if job["engine"].startswith(("llama", "quantize")) else torch_worker
    res = run(job)
    print("RESULT " + json.dumps({**res, "rss_mb": rss_mb()}), flush=True)
    return 0


def spawn(python: str, job: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([python, __file__, "--worker"], input=json.dumps(job), text=True,
                          capture_output=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    why = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
           else f"exit {proc.returncode}")
    fail(f"{job['engine']} run failed ({why}): {reason(proc.stderr)}")


# ---- preparation ----

def ensure_llama(python: Path, work: Path) -> str:
    """llama_cpp's version under `python`, building the venv first when it is missing."""
    if not python.exists():
        venv, log = python.parent.parent, work / "llama-cpp-build.log"
        env = {**os.environ, "CMAKE_ARGS": os.environ.get("CMAKE_ARGS") or cmake_args()}
        print(f"building {LLAMA_CPP_PYTHON} into {venv} with CMAKE_ARGS={env['CMAKE_ARGS']!r}"
              f" (log: {log}) ...", file=sys.stderr)
        t = time.time()
        with log.open("w") as f:
            def step(cmd: list[str]) -> bool:
                return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                      env=env).returncode == 0

            ok = (step([sys.executable, "-m", "venv", str(venv)]) and python.exists()
                  and step([str(python), "-m", "pip", "install", LLAMA_CPP_PYTHON]))
        if not ok:
            fail(f"llama.cpp not installed: {reason(log.read_text())} (log: {log})")
        print(f"built in {time.time() - t:.0f}s", file=sys.stderr)
    proc = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          capture_output=True, text=True)
    if proc.returncode:
        fail(f"llama.cpp not importable by {python}: {reason(proc.stderr)}")
    return proc.stdout.strip()


def converter(python: Path, work: Path, version: str) -> Path:
    """vendor/llama.cpp of llama-cpp-python's sdist: convert_hf_to_gguf.py and gguf-py."""
    root = work / f"llama.cpp-{version}"
    if not (root / "convert_hf_to_gguf.py").exists():
        tmp = Path(tempfile.mkdtemp(dir=work))
        cmd = [str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            fail(f"cannot fetch llama.cpp's converter: {reason(proc.stderr)}")
        with tarfile.open(next(tmp.glob("llama_cpp_python-*.tar.gz"))) as tar:
            for m in tar.getmembers():
                rel = m.name.partition("/vendor/llama.cpp/")[2]
                if rel.startswith(("convert_hf_to_gguf.py", "conversion/", "gguf-py/")):
                    m.name = rel
                    tar.extract(m, root, filter="data")
        shutil.rmtree(tmp)
    return root


def ensure_ggufs(src: Path, work: Path, python: Path, version: str,
                 quants: list[str]) -> dict[str, Path]:
    out = {q: work / f"{src.name}-{q}.gguf" for q in ("F32", *quants)}
    if not out["F32"].exists():
        root, tmp = converter(python, work, version), out["F32"].with_suffix(".tmp")
        env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
        proc = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(src),
                               "--outtype", "f32", "--outfile", str(tmp)],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            fail(f"convert_hf_to_gguf.py failed: {reason(proc.stderr)}")
        tmp.rename(out["F32"])
    for q in quants:
        ftype = QUANTS[q]
        if not out[q].exists():
            tmp = out[q].with_suffix(".tmp")
            job = {"engine": "quantize", "path": str(out["F32"]), "out": str(tmp),
                   "ftype": ftype, "threads": 1}
            if spawn(str(python), job)["rc"]:
                fail(f"llama_model_quantize to {q} failed")
            tmp.rename(out[q])
    return out if "F32" in quants else {q: p for q, p in out.items() if q != "F32"}


def ensure_source(shape: str, work: Path) -> Path:
    """SmolLM2's fp32 folder, or the Qwen2.5-0.5B-shaped one built in `work`."""
    from tq_cli.demo_model import smollm2_folder

    if shape == "smollm2":
        return smollm2_folder()
    import torch

    from tq_cli.bench.synthetic_llama import QWEN25_05B_SMOL, write_synthetic_llama

    folder = work / "qwen2.5-0.5b-shape"
    if not (folder / "config.json").exists():
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_synthetic_llama(tmp, **QWEN25_05B_SMOL, dtype=torch.float32,
                              tokenizer_from=smollm2_folder())
        tmp.rename(folder)
    return folder


def ensure_tq(src: Path, work: Path, bits: int, fast: bool) -> Path:
    from tq_cli.conversion.converter import ConvertSpec, convert
    from tq_cli.quant.spec import QuantSpec

    # the default conversion (an 8-bit head), weight-only for random weights
    folder = work / f"{src.name}-tq{bits}-h8{'-fast' if fast else ''}"
    if not (folder / "config.json").exists():
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        convert(src, tmp, ConvertSpec(quant=QuantSpec(bits=bits), fast=fast))
        tmp.rename(folder)
    return folder


def width(engine: str) -> int | None:
    """The bits of a row's weights: 'tq 3-bit' -> 3, 'llama.cpp Q4_K_M' -> 4, F32 None."""
    found = re.search(r"(\d)-bit|I?Q(\d)_", engine)
    return int(found.group(1) or found.group(2)) if found else None


def size_mb(path: Path) -> float:
    """Weights on disk: the .gguf file, or a folder's .safetensors files."""
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return round(sum(p.stat().st_size for p in files) / 2**20, 1)


def lead(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def main() -> int:
    if sys.argv[1:] == ["--worker"]:
        return worker()
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, default="smollm2")
    ap.add_argument("--bits", default="4", help="tq widths, comma-separated (e.g. 4,3)")
    ap.add_argument("--quants", default="F32,Q4_0,Q4_K_M",
                    help=f"llama.cpp types, comma-separated, of F32 and {', '.join(QUANTS)}")
    ap.add_argument("--tq-folder", type=Path,
                    help="a tq 4-bit checkpoint (default: convert one)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--llama-python", type=Path,
                    default=Path.home() / ".cache/tq/llamacpp-venv/bin/python")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/tq/llamacpp")
    args = ap.parse_args()
    work, python = args.work.expanduser(), args.llama_python.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    version = ensure_llama(python, work)

    from transformers import AutoTokenizer

    from tq_cli.io.text import evaluation_text

    quants = [q for q in args.quants.split(",") if q]
    if unknown := [q for q in quants if q != "F32" and q not in QUANTS]:
        fail(f"unknown llama.cpp type(s) {unknown}: choose from F32, {', '.join(QUANTS)}")
    src = ensure_source(args.shape, work)
    ggufs = ensure_ggufs(src, work, python, version, quants)
    fast = args.shape != "smollm2"
    tq = {b: (args.tq_folder if args.tq_folder and b == 4 else ensure_tq(src, work, b, fast))
          for b in (int(b) for b in args.bits.split(","))}
    tq_folder = tq.get(4)  # the 4-bit checkpoint, for the head-8 variant
    tok = AutoTokenizer.from_pretrained(src)
    prompt = tok(PROMPT).input_ids
    long = tok(evaluation_text().text).input_ids[:args.prefill]
    # A checkpoint that stores its head quantized (tq convert's default) runs it as stored;
    # one that keeps it is also run with the head quantized as it loads.
    stored_head = json.loads((Path(tq_folder) / "config.json").read_text())[
        "quantization_config"].get("head_bits") if tq_folder else True
    mine = [f"tq {b}-bit" for b in tq] + ([] if stored_head else ["tq 4-bit, head 8"])
    engines = {**{f"tq {b}-bit": (sys.executable, "tq", f) for b, f in tq.items()},
               **({} if stored_head else
                  {"tq 4-bit, head 8": (sys.executable, "tq_head8", tq_folder)}),
               "fp32 (transformers)": (sys.executable, "fp32", src),
               **{f"llama.cpp {q}": (str(python), "llama", p) for q, p in ggufs.items()}}
    files = {name: size_mb(path) for name, (_, _, path) in engines.items()}
    runs, info = [], ""
    for threads in (int(t) for t in args.threads.split(",")):
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.rounds):
            for name, (py, engine, path) in engines.items():
                res = spawn(py, {"engine": engine, "path": str(path), "threads": threads,
                                 "tokens": args.tokens, "prompt": prompt, "long": long})
                b, info = best.setdefault(name, res), res.get("system_info", info)
                for k in ("decode", "prefill", "rss_mb"):
                    b[k] = max(b[k], res[k])
        rows = {name: {"decode_tokens_per_s": round(b["decode"], 2),
                       "prefill_tokens_per_s": round(b["prefill"], 1),
                       "peak_rss_mb": round(b["rss_mb"], 1),
                       "rss_before_load_mb": round(b["base_mb"], 1), "file_mb": files[name],
                       "lead_match_fp32": lead(b["ids"], best["fp32 (transformers)"]["ids"]),
                       "lead_match_tq": lead(b["ids"], best[mine[0]]["ids"]),
                       "first_ids": b["ids"]} for name, b in best.items()}
        ratios = {f"{t} / {name}": {k: round(rows[t][k] / r[k], 3) for k in
                                    ("decode_tokens_per_s", "prefill_tokens_per_s",
                                     "peak_rss_mb", "file_mb")}
                  for t in mine
                  for name, r in rows.items()
                  if name.startswith("llama") and width(name) in (None, width(t))}
        runs.append({"threads": threads, "engines": rows, "tq_over_llama_cpp": ratios,
                     "tq_stored_head_bits": stored_head})
        print(f"\nthreads={threads}: decode {args.tokens} tokens after a {len(prompt)}-token "
              f"prompt, prefill {len(long)} tokens, best of {args.rounds}")
        print(f"{'engine':20}{'decode t/s':>11}{'prefill t/s':>12}{'RSS MB':>8}{'(base)':>7}"
              f"{'file MB':>8}{'=fp32':>6}{'=tq':>4}")
        for name, r in rows.items():
            print(f"{name:20}{r['decode_tokens_per_s']:>11.2f}{r['prefill_tokens_per_s']:>12.1f}"
                  f"{r['peak_rss_mb']:>8.0f}{r['rss_before_load_mb']:>7.0f}{r['file_mb']:>8.1f}"
                  f"{r['lead_match_fp32']:>6}{r['lead_match_tq']:>4}")
        for name, q in ratios.items():
            print(f"{name}: decode x{q['decode_tokens_per_s']}, prefill "
                  f"x{q['prefill_tokens_per_s']}, RSS x{q['peak_rss_mb']}, file x{q['file_mb']}")
    report = {"model": src.name, "shape": args.shape, "source": str(src),
              "tq_folders": {b: str(f) for b, f in tq.items()},
              "ggufs": {q: str(p) for q, p in ggufs.items()}, "llama_cpp_python": version,
              "new_tokens": args.tokens, "prompt_tokens": len(prompt),
              "prefill_tokens": len(long), "rounds": args.rounds, "cpu_count": os.cpu_count(),
              "lead_compared": min(LEAD, args.tokens), "runs": runs,
              "llama_cpp_system_info": info}
    from tq_kernels import isas  # what tq's side ran on, beside llama.cpp's system info

    report["tq_cpu_kernels"] = isas.describe()
    print(f"\nllama.cpp: {report['llama_cpp_system_info']}")
    print(f"tq: {report['tq_cpu_kernels']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
