# groupwise: `make demo` trains the embedded default model; `make test` runs the test suite.
# Both create .venv and install pinned dependencies (CPU torch first) when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
TORCH  ?= torch==2.13.0
# pytest workers: one per core this process may use (at most 4: each holds torch and a tiny model); every test
# runs single-threaded (tests/conftest.py), and --dist loadfile keeps a file's module fixtures on one worker
JOBS   ?= $(shell $(PYTHON) -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist loadfile

.PHONY: install sandbox demo lint format test test-slow test-dist test-gpu bench bench-tta claims clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# bubblewrap: the sandbox of the code-execution reward (Debian package)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq bubblewrap; }

demo: $(STAMP)
	$(BIN)/groupwise train demo out=runs/demo

# ruff (format and lint, pyproject.toml [tool.ruff]) over the tree; pyright over the typed core ([tool.pyright])
lint: $(STAMP)
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/pyright --warnings

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint sandbox
	$(PYTEST)

BENCH_STAMP := $(VENV)/.bench-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[bench]'
	@rm -f $(VENV)/.bench-* && touch $@

bench: $(BENCH_STAMP)
	$(BIN)/python bench/run.py $(BENCH_ARGS)

bench-tta: $(BENCH_STAMP)
	$(BIN)/python bench/run.py --tta-seeded $(BENCH_ARGS)

claims: $(STAMP)
	$(BIN)/groupwise claims $(CLAIMS_ARGS)

test-slow: $(STAMP) sandbox
	$(PYTEST) -m slow

# the tests that launch torchrun processes (most are in make test too; the slow ones in test-slow)
test-dist: $(STAMP)
	$(PYTEST) -m dist

# On a machine with a CUDA build of torch (not the CPU build .venv gets): the CUDA suite, tests/test_gpu.py
GPU_PYTHON ?= python3
test-gpu:
	PYTHONPATH=src $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py

clean:
	rm -rf runs .pytest_cache bench/runs
