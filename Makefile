# jaxkv: `make demo` and `make test` each create .venv when it is missing.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Python 3.12+: PYTHON if given, else python3.12/3.13 on PATH, else pyenv's installs.
PYTHON ?= $(shell for c in python3.13 python3.12 python3; do \
	  p=$$(command -v $$c 2>/dev/null) && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; exit; }; \
	done; \
	for p in $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3 /root/.pyenv/versions/3.1[2-9]*/bin/python3; do \
	  [ -x $$p ] && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; exit; }; \
	done)

.PHONY: demo test test-slow test-paper-scale test-gpu-compile test-jax-gpu-version lint venv clean
venv: $(STAMP)

$(STAMP): pyproject.toml
	@if [ -z "$(PYTHON)" ]; then \
	  echo "jaxkv needs Python 3.12 or newer (jax >= 0.11). None found on PATH or under ~/.pyenv/versions."; \
	  echo "Install one (e.g. 'pyenv install 3.12') or run: make PYTHON=/path/to/python3.12 $(MAKECMDGOALS)"; \
	  exit 1; fi
	@[ -x $(PY) ] || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jaxkv demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2

test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 -m slow

# The paper's full-size checks (32 layers x 2,048 steps at block sizes 16 and 1): an hour or more
# on 2 cores, so not in CI; bench/paper_table.py measures the same ordering at 60%.
test-paper-scale: $(STAMP)
	$(PY) -m pytest -q -n 2 -m paper_scale

# Compile the decode loop for an H200 on this (GPU-less) machine and check its structure: no host
# syncs, no per-block loops, bulk host reads (tests/test_gpu_compile.py on a small shape, then
# bench/gpu_ops.py --must-hold --check on the 32-layer Llama-3.1-8B shape: about 2.5 min; then
# bench/gpu_ops_sharded.py --check: the sharded step on 8 H200s, 1x8 and 2x4 meshes).
# Needs the CUDA plugin (the gpu-compile extra, installed here if missing) and /usr/local/cuda.
GPU_COMPILE_CHECK := --must-hold --check
test-gpu-compile: $(STAMP)
	@$(PY) -c 'import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")))' 2>/dev/null \
	  || $(PY) -m pip install -q -e '.[gpu-compile]'
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 -m gpu_compile tests/test_gpu_compile.py \
	  tests/test_gpu_compile_serve.py tests/pallas_kernels/test_kernel_fp8_attention.py
	JAX_PLATFORMS=cpu $(PY) bench/gpu_ops.py $(GPU_COMPILE_CHECK)
	JAX_PLATFORMS=cpu $(PY) bench/gpu_ops_sharded.py --check

# The lent GPU machine runs jax 0.11.2: run the kernel tests (interpreter, race detector,
# lowering for cuda) under that version on CPU before a GPU session spends its minutes.
GPU_JAX := 0.11.2
test-jax-gpu-version: $(STAMP)
	[ -d .jax-$(GPU_JAX) ] || $(PY) -m pip install -q --no-deps --target .jax-$(GPU_JAX) \
	  jax==$(GPU_JAX) jaxlib==$(GPU_JAX)
	PYTHONPATH=$$PWD/.jax-$(GPU_JAX) $(PY) -c 'import jax; print("testing with jax", jax.__version__)'
	PYTHONPATH=$$PWD/.jax-$(GPU_JAX) $(PY) -m pytest -q -n 2 -m "not slow and not gpu" \
	  tests/pallas_kernels tests/test_attention.py tests/test_cache.py tests/test_importance.py \
	  tests/test_decode.py tests/test_transfer.py tests/test_fp8.py tests/test_fp8_age.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .jax-*
