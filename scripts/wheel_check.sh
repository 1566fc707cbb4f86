#!/usr/bin/env bash
# Build tq's platform wheel as `make wheel` does (the CPU kernels compiled into it), install
# it (not editable) into a fresh venv outside the checkout, and run every subcommand once
# from a folder outside the checkout with no C++ compiler on PATH and an empty kernel
# cache, so nothing in the source tree can stand in for what the wheel forgot to ship and
# the native kernels that run can only be the wheel's own.
#
#   bash scripts/wheel_check.sh            (make wheel-check)
#
# torch is installed first by the same rule as `make install` (CPU_TORCH without a GPU).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
CPU_TORCH="${CPU_TORCH:-2.13.0}"
work="$(mktemp -d "${TMPDIR:-/tmp}/tq-wheel-check.XXXXXX")"
trap '/bin/rm -rf "$work"' EXIT
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS" >&2; }
torch_into() {  # venv python
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$1" -m pip install -q torch
  else
    "$1" -m pip install -q "torch==$CPU_TORCH"
  fi
}

step "build the platform wheel (no build isolation: against the torch it targets)"
python3 -m venv "$work/build-venv"
torch_into "$work/build-venv/bin/python"
"$work/build-venv/bin/python" -m pip install -q "setuptools>=68" wheel
rm -rf "$repo/build"  # setuptools builds in the tree: no module deleted since may ride along
"$work/build-venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps \
  -w "$work/dist" "$repo" >/dev/null
wheel="$(ls "$work"/dist/tq-*.whl)"
echo "built $(basename "$wheel")" >&2
case "$(basename "$wheel")" in
  tq-*-py3-none-linux_*.whl) ;;
  *) echo "wheel check: $(basename "$wheel") is not a py3-none-linux platform wheel" >&2; exit 1;;
esac
# The wheel holds both packages, the recipes and the prebuilt kernels, and nothing from
# tests/ or scripts/.
python3 - "$wheel" <<'EOF'
import json, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = z.namelist()
need = ["tq_cli/__init__.py", "tq_cli/bench/__init__.py", "tq_cli/commands/bench.py",
        "tq_cli/io/__init__.py", "tq_kernels/__init__.py", "tq_cli/recipes/llama.toml",
        "tq_cli/recipes/bert.toml", "tq_cli/recipes/generic.toml",
        "tq_kernels/csrc/tq_cpu.cpp", "tq_kernels/csrc/rows.inc",
        "tq_kernels/prebuilt/build.json", "tq_kernels/prebuilt/tq_cpu.so",
        "tq_kernels/prebuilt/fit_cpu.so", "tq_kernels/prebuilt/kv_cpu.so"]
missing = [n for n in need if n not in names]
stray = [n for n in names if n.split("/")[0] in ("tests", "scripts", "kernels", "recipes")]
if missing or stray:
    sys.exit(f"wheel check: missing {missing}, stray {stray}")
print("prebuilt for torch", json.loads(z.read("tq_kernels/prebuilt/build.json"))["torch"],
      file=sys.stderr)
EOF

step "install it into a fresh venv"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
torch_into "$py"
"$py" -m pip install -q "$wheel[models]"
# From here on no compiler: PATH is the venv's bin folder alone, CXX unset, and tq's
# kernel cache empty, so only the wheel's prebuilt libraries can give the native kernels.
export PATH="$work/venv/bin" TQ_CACHE="$work/tq-cache"
unset CXX
tq="$work/venv/bin/tq"

cd "$work"   # never the checkout: imports must come from the installed wheel
step "tq --help"
"$tq" --help >/dev/null
"$py" -c "import tq_cli, tq_kernels, sys; assert '$repo' not in tq_cli.__file__; print(tq_cli.__file__)"
step "the native kernels are the wheel's, with no compiler"
"$py" - <<'EOF'
from tq_kernels import cpu, cpu_build, fit, kv
assert cpu_build.compiler() is None, cpu_build.compiler()
built = [m._built() for m in (cpu, fit, kv)]
assert all(b.prebuilt for b in built), [b.error for b in built]
assert cpu.available() and fit.available() and kv.available()
print("native kernels:", cpu.active_isa(), [b.path.name for b in built])
EOF

step "a tiny model"
HF_HUB_OFFLINE=1 "$py" -c "
import sys; sys.path.insert(0, '$repo/tests')
from pathlib import Path
from tinymodels import build_tiny_llama
build_tiny_llama(Path('tiny'))"

step "tq convert"
"$tq" convert tiny -o tiny-tq --bits 4 --group-size 32 --json >convert.json
step "tq eval"
"$tq" eval tiny-tq --reference tiny --context 64 --max-tokens 512 --json >eval.json
step "tq search-seed over 2 seeds"
"$tq" search-seed tiny 0..1 -o seeds.json --group-size 32 --json >search.json
step "tq calibrate, and a calibrated convert"
"$tq" calibrate tiny -o tiny.calib --samples 4 --seqlen 32 --json >calib.json
"$tq" convert tiny -o tiny-tq3 --bits 3 --group-size 32 --calib tiny.calib --json >convert3.json
step "tq bench --quick --section quality"
"$tq" bench --quick --section quality --json bench.json >/dev/null
"$py" - <<'EOF'
import json
c = json.load(open("convert.json")); c3 = json.load(open("convert3.json"))
e = json.load(open("eval.json")); b = json.load(open("bench.json"))
assert 4 < c["bits_per_weight"] < 5 and 3 < c3["bits_per_weight"] < 4, (c, c3)
assert e["kind"] == "causal-lm" and e["metrics"]["scored_tokens"] > 0, e
assert json.load(open("seeds.json")) and json.load(open("calib.json"))
assert list(b["sections"]) == ["quality"] and b["metrics"], b.keys()
print(f"wheel check: ok (tq4 {c['bits_per_weight']:.3f} bits/w, "
      f"KL {e['metrics']['kl_mean']:.4f})")
EOF
step "generate() with no compiler (the kernels prebuilt, the decode step eager)"
"$py" - <<'EOF'
import os, torch, tq_cli
model = tq_cli.load("tiny-tq")
assert not getattr(model, "tq_compiled", False)  # inductor would need a compiler
with torch.no_grad():
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, min_new_tokens=4,
                         do_sample=False)
assert out.shape == (1, 7), out.shape
kernels = os.path.join(os.environ["TQ_CACHE"], "kernels")
built = os.listdir(kernels) if os.path.isdir(kernels) else []
assert not built, f"wheel check: compiled into {kernels}: {built}"
print("generate:", out[0, 3:].tolist())
EOF
step "done"
