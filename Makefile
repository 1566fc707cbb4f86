# tq: install, demo, test, lint, bench.
#
# `make install` builds .venv. torch is installed first and explicitly, so pip never
# resolves an unpinned `torch` to a multi-GB CUDA build on a machine without a GPU:
#   - no GPU (no nvidia-smi): torch==$(CPU_TORCH), with $(TORCH_INDEX) as index if set
#     (on this project's machines pip finds a local CPU wheel of 2.13.0; elsewhere set
#     TORCH_INDEX=https://download.pytorch.org/whl/cpu to get the CPU build);
#   - a GPU: the normal (CUDA) torch from PyPI.
# pyproject's `torch>=2.3` is then already satisfied and installs nothing more.
#
# Dependencies have lower bounds only: `make install` resolves what pip finds that day,
# and CI (which runs it from a clean clone) catches a release that breaks tq.
# constraints.txt records the versions the last green CI ran with; `make install-locked`
# installs exactly those, and `make lock` rewrites the file from .venv.

VENV ?= .venv
PY := $(VENV)/bin/python
CPU_TORCH ?= 2.13.0
TORCH_INDEX ?=
DEMO_OUT ?= $(HOME)/.cache/tq/demo/SmolLM2-135M-Instruct-tq4
CONSTRAINTS ?=

.PHONY: install install-locked lock demo test test-isa lint bench bench-quick wheel wheel-check clean vllm-test

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q "torch==$(CPU_TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
	fi
	$(PY) -m pip install -q -e ".[dev]" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $@

install-locked:
	rm -f $(VENV)/.installed
	$(MAKE) install CONSTRAINTS=constraints.txt

lock: install
	{ echo "# Versions tq was last tested with (make lock); make install-locked uses them."; \
	  $(PY) -m pip freeze --exclude-editable | sed -e 's/+cpu$$//' | grep -v '^-e '; } > constraints.txt

demo: install
	@model=$$($(PY) -m tq_cli.demo_model) && \
	$(VENV)/bin/tq convert "$$model" -o $(DEMO_OUT) --bits 4 --overwrite

test: install
	$(PY) -m pytest -q

# The suite again for each narrower instruction set of tq's CPU kernels this CPU runs
# (avx2, then scalar: plain x86-64), TQ_CPU_ISA capping tq's kernels and the variables below
# capping torch's own (ATen's vectorised kernels, oneDNN, MKL), so a machine with AVX-512
# runs what an AVX2 laptop or an old x86-64 box runs, the references' sums included.
# Each pass compiles into its own inductor cache: with the shared one, compiled decode
# steps of the AVX2 pass (ATEN_CPU_CAPABILITY=avx2) decoded NaN after steps cached by
# the default pass, and were exact with a fresh cache (docs/decisions.md).
ISA_ENV_avx2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
ISA_ENV_scalar := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2

test-isa: install
	@isas=$$($(PY) -m tq_kernels.isas --narrower) || exit 1; \
	if [ -z "$$isas" ]; then echo "test-isa: no narrower instruction set on this CPU"; fi; \
	for isa in $$isas; do \
		case $$isa in avx2) e="$(ISA_ENV_avx2)";; *) e="$(ISA_ENV_scalar)";; esac; \
		echo "== test-isa: TQ_CPU_ISA=$$isa $$e"; \
		c=$$(mktemp -d); \
		env TQ_CPU_ISA=$$isa $$e TORCHINDUCTOR_CACHE_DIR=$$c $(PY) -m pytest -q -p no:cacheprovider; \
		r=$$?; rm -rf $$c; [ $$r -eq 0 ] || exit 1; \
	done

lint: install
	$(VENV)/bin/ruff check tq_cli kernels tests scripts
	$(VENV)/bin/mypy tq_cli kernels/tq_kernels

bench: install
	$(VENV)/bin/tq bench

bench-quick: install
	$(VENV)/bin/tq bench --quick --baseline .ci/bench-baseline-cpu.json

# The platform wheel: tq with its CPU kernels compiled in (setup.py, tq_kernels/prebuild.py),
# built against .venv's torch (no build isolation), into dist/.
wheel: install
	rm -rf build
	$(PY) -m pip wheel -q --no-build-isolation --no-deps -w dist .

wheel-check:
	bash scripts/wheel_check.sh

# tq checkpoints in vLLM (tests/test_vllm.py, marked `vllm`), in a venv of their own built
# by scripts/vllm_env.sh (vLLM's CPU build without a GPU), so .venv is never touched.
VLLM_VENV ?= .venv-vllm

$(VLLM_VENV)/.installed: pyproject.toml scripts/vllm_env.sh
	VLLM_VENV=$(VLLM_VENV) bash scripts/vllm_env.sh
	touch $@

vllm-test: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_vllm.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info build dist
