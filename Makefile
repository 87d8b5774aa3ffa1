# tidal: `make demo` is RL post-training on CPU: it warm-starts the debug model on addition
# with SFT (cached after the first run), then runs GRPO through the store and prints held-out
# pass@1 before and after; `make demo-tools` does the same with the calc tool (multi-turn).
# `make demo-pretrain` trains the debug model on Shakespeare;
# `make test` runs lint (ruff, mypy) and the tests.
# Both create .venv on first use and reuse it (and the downloaded corpus) afterwards.
PYTHON ?= python3
VENV ?= .venv
# torch: with an NVIDIA GPU (nvidia-smi lists one), the default (CUDA) build from PyPI;
# without one, the CPU build from PyTorch's CPU wheel index when it answers within 5 s (no
# CUDA libraries: a few hundred MB instead of several GB), else the plain package (a CPU
# build lying on disk on the dev/CI machines). TORCH_SPEC picks the version, e.g.
# TORCH_SPEC=torch==2.11.0; TORCH_CPU_INDEX= (empty) skips the CPU index.
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.tidal-installed
TEST_STAMP := $(VENV)/.tidal-test-installed

.PHONY: demo-async demo-tools setup setup-test demo demo-pretrain test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "installing $(TORCH_SPEC) (CUDA build: a GPU is present)"; \
		$(BIN)/python -m pip install -q "$(TORCH_SPEC)"; \
	elif [ -n "$(TORCH_CPU_INDEX)" ] && $(BIN)/python -c "import urllib.request; \
		urllib.request.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" >/dev/null 2>&1; then \
		echo "installing $(TORCH_SPEC) (CPU build from $(TORCH_CPU_INDEX): no GPU)"; \
		$(BIN)/python -m pip install -q --index-url "$(TORCH_CPU_INDEX)" "$(TORCH_SPEC)"; \
	else \
		echo "installing $(TORCH_SPEC) (no GPU; $(TORCH_CPU_INDEX) unreachable: plain package)"; \
		$(BIN)/python -m pip install -q "$(TORCH_SPEC)"; \
	fi
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	# gsm_symbolic's generators need none of reasoning-gym's dependencies (tidal reads them by path)
	$(BIN)/python -m pip install -q --no-deps reasoning-gym==0.1.25
	# float8 training (quantize.float8) is optional; its CPU tests run torchao's emulated path
	$(BIN)/python -m pip install -q --no-deps torchao==0.18.0
	touch $(STAMP)

setup-test: $(TEST_STAMP)

# What only the tests need, kept out of `make demo`'s set-up.
$(TEST_STAMP): $(STAMP)
	# tests/train/test_torchtitan_checkpoint.py checks tidal's torchtitan conversions against
	# torchtitan's own models and checkpoint code. --no-deps: what its model and checkpoint
	# modules import is here already (.[dev]) but for tyro and its two small dependencies, and
	# torchdata (0.8 MB of wheels, 7 MB installed, ~5 s). Its import of the MoE kernels needs
	# triton: torch's CUDA builds bring it; for a CPU build it is installed here (286 MB
	# download, 1 GB installed, ~20 s).
	$(BIN)/python -m pip install -q --no-deps torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 \
		docstring-parser==0.18.0 typeguard==4.6.1
	$(BIN)/python -c "import triton" 2>/dev/null || \
		$(BIN)/python -m pip install -q --no-deps triton==3.9.0
	# tests/serve: the serve extra (FastAPI, uvicorn) and the clients the tests drive it with:
	# httpx (FastAPI's TestClient) and the official openai client (the version verifiers 0.4.0
	# brings).
	$(BIN)/python -m pip install -q fastapi==0.163.2 uvicorn==0.54.0 httpx==0.28.1 openai==2.54.0
	# tests/store/test_nixl.py: the nixl extra (~120 MB; UCX inside). --no-deps: it needs only
	# torch and numpy, here already (without it pip may fetch a CUDA torch).
	$(BIN)/python -m pip install -q --no-deps nixl-cu12==1.5.1
	touch $(TEST_STAMP)

demo: setup
	rm -rf outputs/rl_addition  # a fresh run refuses a folder holding an earlier run's metrics
	$(BIN)/tidal rl --config rl_addition

demo-async: setup  # the demo's config in async mode, then both runs side by side
	test -f outputs/rl_addition/metrics.jsonl || $(MAKE) demo
	rm -rf outputs/rl_addition_async
	$(BIN)/tidal rl --config rl_addition --rl.mode async --loss.tis_cap 2.0 \
		--job.output_dir outputs/rl_addition_async
	$(BIN)/python -m tidal.rl.compare outputs/rl_addition outputs/rl_addition_async

demo-tools: setup  # GRPO with the calc tool: an SFT warm start that calls it 40% of the time, then RL
	rm -rf outputs/rl_calculator  # a fresh run refuses a folder holding an earlier run's metrics
	OMP_NUM_THREADS=1 $(BIN)/tidal rl --config rl_calculator  # one thread, as measured (docs/rl.md)

demo-pretrain: setup
	$(BIN)/tidal fetch shakespeare
	rm -rf outputs/debug  # a fresh run refuses a folder holding an earlier run's metrics
	$(BIN)/tidal train --config debug

lint: setup-test
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
