"""llama.cpp's quantizer as a peer: its types, with an importance matrix, written out dequantized.

Usage (the project's venv: torch, safetensors, gguf and tq_cli are all it needs):
    python scripts/peers_llamacpp.py SOURCE OUT_ROOT [--types Q4_K_M,IQ4_XS,Q3_K_M,...]
        [--no-imatrix] [--work DIR] [--threads 2] [--kld-check Q4_K_M]
        [--only '*.mlp.down_proj.weight' --suffix=-down]
    tq eval OUT_ROOT/llamacpp-Q4_K_M-imat --reference SOURCE --json     (and each type)
The rows join OUT_ROOT/peers.json beside `scripts/peers_external.py`'s (same fields).

llama.cpp itself: its own tools, `llama-imatrix`, `llama-quantize` and `llama-perplexity`,
built with CMake from the llama.cpp that llama-cpp-python's sdist vendors
(`LLAMA_CPP_PYTHON` below; `--work`, default ~/.cache/tq/llamacpp-tools, keeps the
sources, the build and the GGUFs between runs; the build is Release, GGML_NATIVE, no
curl, about 15 minutes on one core). The F32 GGUF is made by that llama.cpp's own
`convert_hf_to_gguf.py` (run by this interpreter with its gguf-py).

What is run, per type T (llama.cpp's names, as `llama-quantize --help` lists them):
- the importance matrix, once: `llama-imatrix -m F32.gguf -f CALIB.txt -c 512` on the
  text `tq calibrate` (and so `tq convert --calib`) uses, `tq_cli.io.text.calibration_text()`,
  tokenised by llama.cpp (SmolLM2: about 97 windows of 512 tokens, as tq's 97 rows);
- `llama-quantize --imatrix IMATRIX --token-embedding-type f32 --output-tensor-type f32
  F32.gguf T.gguf T`: the embedding and the head kept in f32, so that, as for every other
  peer here, only the transformer blocks' linear layers are quantized (the type's own
  mix inside them is untouched: Q4_K_M still puts some attn_v and ffn_down in Q6_K);
- `--no-imatrix` writes the same types without it (folders `llamacpp-T`).
- `--only GLOB`: only the plan's tensors matching GLOB are replaced (and counted), the
  rest kept as SOURCE has them; folders get `--suffix`. K- and i-quants need rows of a
  multiple of 256 columns; llama.cpp quantizes a narrower row with a fallback type
  (SmolLM2's 576-wide inputs: Q5_0, Q4_0, IQ4_NL), so on such a model only the tensors
  with a 256-multiple input (SmolLM2's down_proj, 1536) hold the type asked for.

Dequantized back to a folder (OUT_ROOT/llamacpp-T-imat): every tensor of the plan tq's
recipe makes for SOURCE (the attention and MLP projections) is read from the GGUF and
dequantized with gguf-py's `gguf.quants.dequantize` (numpy ports of ggml's
dequantization, every K- and i-quant), in float32; everything else is SOURCE's. GGUF
names come from gguf's own HF-to-GGUF tensor map, and the converter's q/k head
permutation (Llama's rotary layout) is found per tensor on the F32 GGUF, where a
dequantized tensor must equal the source exactly (checked: the script refuses to go on
otherwise) and undone the same way on the quantized ones.

Bits per weight as tq counts them: the bytes llama.cpp stores for those tensors (the
GGUF's own size of each, block scales and mins included) over their weight count.

`--kld-check T`: llama.cpp's own measure of the same thing, `llama-perplexity
--kl-divergence` of T.gguf against F32.gguf on the first --kld-chunks windows of 512 tokens of
tq's evaluation text, for comparison with `tq eval` on the dequantized folder. The two
differ by construction: llama-perplexity scores the second half of each window only,
and runs the quantized dot products against 8-bit quantized activations; `tq eval`
scores every token of its windows in float32.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from peers_external import converted_names
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
TOOLS = ("llama-imatrix", "llama-quantize", "llama-perplexity")
TYPES = ("Q4_K_M", "IQ4_XS", "Q3_K_M", "IQ3_XXS", "IQ2_XS")


def fail(msg: str) -> None:
    print(f"peers_llamacpp: {msg}", file=sys.stderr)
    raise SystemExit(2)


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> str:
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    text = log.read_text(errors="replace")
    if proc.returncode:
        fail(f"{Path(cmd[0]).name} failed (exit {proc.returncode}, log {log}): "
             f"{text.strip().splitlines()[-1] if text.strip() else ''}")
    return text


def ensure_tools(work: Path) -> tuple[Path, Path]:
    """(llama.cpp's source root, its build's bin folder), fetched and built when missing."""
    src = work / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        tmp = Path(tempfile.mkdtemp(dir=work))
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
             ":all:", LLAMA_CPP_PYTHON, "-d", str(tmp)], work / "download.log")
        with tarfile.open(next(tmp.glob("llama_cpp_python-*.tar.gz"))) as tar:
            for m in tar.getmembers():
                rel = m.name.partition("/vendor/llama.cpp/")[2]
                if rel:
                    m.name = rel
                    tar.extract(m, src, filter="data")
        shutil.rmtree(tmp)
    bin_dir = src / "build" / "bin"
    if not all((bin_dir / t).exists() for t in TOOLS):
        print(f"building {', '.join(TOOLS)} in {src / 'build'} ...", file=sys.stderr)
        t0 = time.time()
        run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DBUILD_SHARED_LIBS=OFF"], work / "cmake.log")
        run(["cmake", "--build", str(src / "build"), "-j", str(os.cpu_count() or 1),
             "--target", *TOOLS], work / "build.log")
        print(f"built in {time.time() - t0:.0f} s", file=sys.stderr)
    return src, bin_dir


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute (rotary halves interleaved per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def gguf_tensors(path: Path) -> dict[str, object]:
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def dequantized(t: object) -> torch.Tensor:
    """A GGUF tensor in float32 [rows, cols] (GGUF lists its shape innermost first)."""
    import gguf

    arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)  # type: ignore[attr-defined]
    shape = [int(d) for d in reversed(t.shape)]  # type: ignore[attr-defined]
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # a copy


def mapping(source: dict[str, torch.Tensor], names: list[str], config: dict,
            f32: Path) -> dict[str, tuple[str, int]]:
    """HF name -> (GGUF name, heads of the permutation undone, 0 for none), each checked
    on the F32 GGUF: its dequantized tensor equals the source exactly."""
    import gguf

    reader = gguf.GGUFReader(f32)  # parsed once: a large vocabulary takes a while
    name_of = reader.fields["general.architecture"].contents()
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name_of)
    tmap = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tensors = {t.name: t for t in reader.tensors}
    heads = {config["num_attention_heads"], config.get("num_key_value_heads") or 0} - {0}
    out: dict[str, tuple[str, int]] = {}
    for name in names:
        g = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if g is None or g not in tensors:
            fail(f"{f32.name}: no GGUF tensor for '{name}' (mapped to {g!r})")
        w, ref = dequantized(tensors[g]), source[name].float()
        found = next((h for h in (0, *sorted(heads)) if torch.equal(
            unpermute(w, h) if h else w, ref)), None)
        if found is None:
            fail(f"{f32.name}: tensor '{g}' does not hold '{name}' (nor a head permutation)")
        out[name] = (g, found)
    return out


def mean_kld(text: str) -> float:
    m = re.search(r"Mean\s+KLD:\s*([0-9.eE+-]+)", text)
    if not m:
        fail("llama-perplexity printed no mean KLD")
    return float(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out_root", type=Path)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--no-imatrix", action="store_true")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/tq/llamacpp-tools")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--kld-check", default="")
    ap.add_argument("--kld-chunks", type=int, default=8)
    ap.add_argument("--only", default="*")
    ap.add_argument("--suffix", default="")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out_root.mkdir(parents=True, exist_ok=True)
    src_root, bin_dir = ensure_tools(args.work)
    sys.path.insert(0, str(src_root / "gguf-py"))  # the gguf-py that wrote the GGUFs
    models = args.work / args.source.name
    models.mkdir(exist_ok=True)
    f32 = models / "F32.gguf"
    if not f32.exists():
        env = {**os.environ, "PYTHONPATH": str(src_root / "gguf-py")}
        run([sys.executable, str(src_root / "convert_hf_to_gguf.py"), str(args.source),
             "--outtype", "f32", "--outfile", str(f32.with_suffix(".tmp"))],
            models / "convert.log", env)
        f32.with_suffix(".tmp").rename(f32)
    from tq_cli.io.text import calibration_text, evaluation_text

    imatrix = models / "imatrix.gguf"
    if not args.no_imatrix and not imatrix.exists():
        calib = models / "calibration.txt"
        calib.write_text(calibration_text().text)
        t0 = time.time()
        run([str(bin_dir / "llama-imatrix"), "-m", str(f32), "-f", str(calib), "-c", "512",
             "-t", str(args.threads), "-o", str(imatrix)], models / "imatrix.log")
        print(f"imatrix: {time.time() - t0:.0f} s", file=sys.stderr)

    config = json.loads((args.source / "config.json").read_text())
    names = [n for n in converted_names(args.source, ROOT / ".venv" / "bin" / "python")
             if fnmatch.fnmatchcase(n, args.only)]
    if not names:
        fail(f"no tensor of the plan matches --only {args.only!r}")
    source: dict[str, torch.Tensor] = {}
    for f in sorted(args.source.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                source[name] = fh.get_tensor(name)
    where = mapping(source, names, config, f32)
    numel = sum(source[n].numel() for n in names)
    print(f"{len(names)} tensors, {numel} weights; GGUF names and permutations checked "
          f"on {f32}", file=sys.stderr)

    results = args.out_root / "peers.json"
    report = json.loads(results.read_text()) if results.exists() else {
        "source": str(args.source), "tensors": len(names), "weights": numel, "methods": {}}
    tag = "" if args.no_imatrix else "-imat"
    for qtype in [t for t in args.types.split(",") if t]:
        gg = models / f"{qtype}{tag}.gguf"
        t0 = time.time()
        if not gg.exists():
            extra = [] if args.no_imatrix else ["--imatrix", str(imatrix)]
            run([str(bin_dir / "llama-quantize"), *extra, "--token-embedding-type", "f32",
                 "--output-tensor-type", "f32", str(f32), str(gg.with_suffix(".tmp")), qtype,
                 str(args.threads)], models / f"quantize-{qtype}{tag}.log")
            gg.with_suffix(".tmp").rename(gg)
        seconds = time.time() - t0
        tensors = gguf_tensors(gg)
        out = dict(source)
        bits, errs, kinds = 0, [], {}
        for name in names:
            g, heads = where[name]
            t = tensors[g]
            w = dequantized(t)
            w = unpermute(w, heads) if heads else w
            ref = source[name].float()
            bits += int(t.n_bytes) * 8  # type: ignore[attr-defined]
            errs.append(float((ref - w).pow(2).sum() / ref.pow(2).sum().clamp(min=1e-30)))
            kind = t.tensor_type.name  # type: ignore[attr-defined]
            kinds[kind] = kinds.get(kind, 0) + 1
            out[name] = w.to(source[name].dtype)
        folder = args.out_root / f"llamacpp-{qtype}{tag}{args.suffix}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in out.items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})
        for f in args.source.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
                shutil.copy2(f, folder / f.name)
        row = {"folder": str(folder), "gguf": str(gg), "type": qtype, "only": args.only,
               "imatrix": not args.no_imatrix, "bits_per_weight": bits / numel,
               "mean_rel_error": sum(errs) / len(errs), "max_rel_error": max(errs),
               "tensor_types": kinds, "seconds": round(seconds, 1)}
        if qtype == args.kld_check:
            ev = models / "evaluation.txt"
            ev.write_text(evaluation_text().text)
            base = models / "F32.kld"
            common = ["-f", str(ev), "-c", "512", "--chunks", str(args.kld_chunks), "-t",
                      str(args.threads), "--kl-divergence-base", str(base)]
            if not base.exists():
                run([str(bin_dir / "llama-perplexity"), "-m", str(f32), *common],
                    models / "kld-base.log")
            row["llamacpp_kld"] = mean_kld(run(
                [str(bin_dir / "llama-perplexity"), "-m", str(gg), *common, "--kl-divergence"],
                models / f"kld-{qtype}{tag}.log"))
            row["llamacpp_kld_tokens"] = args.kld_chunks * 256
        report["methods"][folder.name] = row
        results.write_text(json.dumps(report, indent=2) + "\n")
        print(f"{folder.name}: {row['bits_per_weight']:.4f} bits/weight, mean rel. error "
              f"{row['mean_rel_error']:.3e}, types {kinds}"
              + (f", llama.cpp KLD {row['llamacpp_kld']:.4f}" if "llamacpp_kld" in row else "")
              + f" -> {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
