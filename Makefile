# The README's two commands: `make demo` (the embedded default run) and `make test`.
# Both create .venv and install what they need first. On a machine without CUDA, the CPU build
# of torch is installed before the project, because a plain `torch` requirement pulls a
# multi-GB CUDA build. GPU users: `make install TORCH_SPEC=torch` (or install their own torch first).

PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/swarmrl rl

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_sampler.py
	$(BIN)/python benchmarks/bench_async.py
	$(BIN)/python benchmarks/bench_orchestrator.py

clean:
	rm -rf $(VENV) .cache runs
