# Quick start: `make demo` (train a tiny model on CPU) and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-all lint format clean

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]' $(foreach d,$(PLUGIN_DIRS),-e ./$(d))
	touch $@

venv: $(STAMP)

DEMO_DIR ?= runs/demo

demo: $(STAMP)
	$(BIN)/axplug list
	$(BIN)/axplug train --preset llama-tiny --output-dir $(DEMO_DIR) --checkpoint-every 100
	$(BIN)/python examples/sample_demo.py $(DEMO_DIR) "HAMLET."

test: $(STAMP)
	$(BIN)/python -m pytest

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "slow or not slow"

lint: $(STAMP)
	$(BIN)/ruff check core plugins tests examples
	$(BIN)/ruff format --check core plugins tests examples

format: $(STAMP)
	$(BIN)/ruff format core plugins tests examples
	$(BIN)/ruff check --fix core plugins tests examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

.PHONY: bench-quick

# Step and compile time of llama-tiny against the same model in plain JAX (about a minute).
bench-quick: $(STAMP)
	$(BIN)/python bench/step_time.py --quick
