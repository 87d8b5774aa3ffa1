# tidal: `make demo` trains the debug model on Shakespeare; `make test` runs lint (ruff,
# mypy) and the tests.
# Both create .venv on first use and reuse it (and the downloaded corpus) afterwards.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default (it lies on disk on the dev/CI machines); a GPU user can pass e.g.
# TORCH_SPEC=torch==2.11.0 or TORCH_SPEC=torch to take a CUDA build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.tidal-installed

.PHONY: setup demo test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# gsm_symbolic's generators need none of reasoning-gym's dependencies (tidal reads them by path)
	$(BIN)/python -m pip install -q --no-deps reasoning-gym==0.1.25
	touch $(STAMP)

demo: setup
	$(BIN)/tidal fetch shakespeare
	rm -rf outputs/debug  # a fresh run refuses a folder holding an earlier run's metrics
	$(BIN)/tidal train --config debug

lint: setup
	$(BIN)/ruff check tidal tests benchmarks
	$(BIN)/ruff format --check tidal tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

format: setup
	$(BIN)/ruff format tidal tests benchmarks
	$(BIN)/ruff check --fix tidal tests benchmarks

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache
