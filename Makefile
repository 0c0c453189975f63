# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: venv demo ruff lint test test-fast test-integration bench clean

venv: $(STAMP)

$(STAMP): requirements/base.txt requirements/test.txt requirements/constraints.txt pyproject.toml
	# Mooncake's CPU build links libibverbs (Debian libibverbs1, with libnl): the system's, as root with apt
	@ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null || \
	    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null; }; }; } || \
	  echo "make venv: libibverbs.so.1 missing (install libibverbs1): extract.transfer = mooncake will not work"
	$(PY) -m venv $(VENV)
	# torch 2.13.0 CPU under a constraint: speculators' unpinned torchvision/torchaudio would
	# otherwise pull a CUDA torch (docs/reference.md §3.1). Nothing here imports those three.
	$(BIN)/pip install -q -c requirements/constraints.txt -r requirements/base.txt -r requirements/test.txt
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, speculators, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: venv
	$(BIN)/eagle3-console run demo --no-tui

# ruff alone (pyproject.toml [tool.ruff]): a second or two.
ruff: venv
	$(BIN)/ruff check pipeline console tests bench

# ruff, then mypy on pipeline/ and console/ ([tool.mypy]), ~25 s cold, seconds warm; `make test` and `make test-fast` run it first.
lint: ruff
	$(BIN)/mypy

# The tests are in two lanes, marked by what they start (tests/conftest.py, pyproject.toml's markers):
# integration (alias slow) starts real vLLM servers or probes, trainings, pipeline stages, Mooncake, torchrun.
# test: CI (.ci/run) and before a push: lint, then every test of both lanes, over two pytest-xdist workers
# (one worker kept 2 cores ~56 % busy: half the lane is waiting on servers and children; the session fixtures
# are built once for both, tests/conftest.py once_per_suite; each test's runs on ports of their own).
# TEST_WORKERS=0 runs it in one process (NOTES "Test suite").
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=30

# test-fast: on every change: ruff, then the tests that start nothing heavy (-m "not integration"), <= 3 min on 2 cores:
# over the same two workers (one process: 3 m 38 s, two: 2 m 10 s, 2026-12-07 — it too waits on children).
test-fast: lint
	$(BIN)/python -m pytest -q -m "not integration" -n $(TEST_WORKERS) --dist loadscope --durations=10

# test-integration: the integration lane alone (what test-fast leaves out); narrow it with ARGS, e.g.
# make test-integration ARGS=tests/test_lifetimes.py
test-integration: venv
	$(BIN)/python -m pytest -q -m integration --durations=15 $(ARGS)

bench: venv
	$(BIN)/python bench/demo_stages.py

clean:
	rm -rf $(VENV) runs
