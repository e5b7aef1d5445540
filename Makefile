# Quick start: `make demo` (train a tiny model on CPU) and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
# `[test]` for a plugin whose pyproject.toml defines test extras (e.g. object-store servers).
TEST_EXTRA = $(if $(shell grep -s '^test = ' $(d)/pyproject.toml),[test])
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-all test-slow golden compile-budget lint format clean

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# The build backend once in the venv, and no isolated build environment per distribution
	@# (one each, fetching setuptools, for ~30 editable installs).
	$(BIN)/python -m pip install -q --upgrade pip 'setuptools>=77'
	$(BIN)/python -m pip install -q --no-build-isolation -e '.[test]' \
		$(foreach d,$(PLUGIN_DIRS),-e './$(d)$(TEST_EXTRA)')
	@# Bytecode for the editable sources, as pip writes it for installed packages: every test
	@# worker and child interpreter imports them.
	$(BIN)/python -m compileall -q -j 0 conftest.py core plugins tests
	touch $@

venv: $(STAMP)

DEMO_DIR ?= runs/demo
# What `make demo` uses: the core and the plugin of llama-tiny's RoPE, without test extras
# (`make test` adds every plugin and the test tools to the same venv).
DEMO_PLUGINS := plugins/attention
DEMO_STAMP := $(VENV)/.demo-installed

$(DEMO_STAMP): pyproject.toml $(DEMO_PLUGINS:%=%/pyproject.toml)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e . $(foreach d,$(DEMO_PLUGINS),-e './$(d)')
	touch $@

demo: $(DEMO_STAMP)
	$(BIN)/axplug list --by-dist
	$(BIN)/axplug train --preset llama-tiny --output-dir $(DEMO_DIR) --checkpoint-every 100
	$(BIN)/axplug generate --checkpoint $(DEMO_DIR) --prompt "HAMLET." --max-new-tokens 300 \
		--temperature 0.8 --top-p 0.95

# The default suite; it prints the 25 slowest tests and the tests that compile or spawn most,
# and fails when its backend compiles grow more than 10% over tests/compile_budget.json.
# Workers: pytest-xdist processes (2 cores: 2 measured 1.6x one, 3 kept both cores busy while
# the others wait on children; `TEST_WORKERS=0` runs in this process). Tests are handed out one
# at a time (worksteal): the long ones don't queue up.
COMPILE_BUDGET := tests/compile_budget.json
TEST_WORKERS ?= 3
XDIST = -n $(TEST_WORKERS) $(if $(filter 0,$(TEST_WORKERS)),,--dist worksteal)

# pytest caches the test modules it rewrites (for assertion messages) in __pycache__, unless
# told to write no bytecode: then each worker rewrites all ~330 again (~3 of its 7 s).
PYTEST = env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest

test: $(STAMP)
	$(PYTEST) $(XDIST) --durations=25 --compile-budget=$(COMPILE_BUDGET)

test-all: $(STAMP)
	$(PYTEST) $(XDIST) -m "slow or not slow" --durations=25

test-slow: $(STAMP)
	$(PYTEST) $(XDIST) -m slow --durations=10

# After an intended change of numerics: rewrite tests/golden/*.json (then commit them).
golden: $(STAMP)
	AXPLUG_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/test_golden_losses.py

# After intended new compiles (a new program, not a program compiled again): rewrite the budget.
compile-budget: $(STAMP)
	$(PYTEST) -q $(XDIST) --compile-budget=$(COMPILE_BUDGET) --write-compile-budget

# Type-checked: the packages plugins build on, and the trainer (the settings are
# pyproject.toml's [tool.mypy]).
TYPED := core/axplug/config core/axplug/registry core/axplug/trainer $(wildcard core/axplug/api)
# Every plugin package, checked against the plugin API with the same settings.
PLUGIN_PACKAGES := $(filter-out %.egg-info,$(wildcard plugins/*/axplug_*))
empty :=
PLUGIN_ROOTS := $(subst $(empty) $(empty),:,$(wildcard plugins/*))

lint: $(STAMP)
	$(BIN)/ruff check conftest.py core plugins tests examples
	$(BIN)/ruff format --check conftest.py core plugins tests examples
	MYPYPATH=$(PLUGIN_ROOTS) $(BIN)/mypy $(TYPED) $(PLUGIN_PACKAGES)
	@# The `axplug new-plugin` templates (package data, not modules): rendered for every kind,
	@# then linted under the generated packages' own ruff settings.
	@out=$$(mktemp -d) && trap 'rm -rf "$$out"' EXIT && \
	$(BIN)/python -c "import sys; from axplug_scaffold.command import KINDS, generate; \
		[generate(f'axplug-lint-{k}', k, sys.argv[1]) for k in KINDS]; \
		generate('axplug-lint-pair', 'layer', sys.argv[1], with_modifier=True)" "$$out" && \
	$(BIN)/ruff check -q "$$out" && $(BIN)/ruff format -q --check "$$out" && \
	echo "new-plugin templates: every kind renders and lints clean"

format: $(STAMP)
	$(BIN)/ruff format conftest.py core plugins tests examples
	$(BIN)/ruff check --fix conftest.py core plugins tests examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

.PHONY: bench-quick bench
BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP) bench/requirements.txt
	$(BIN)/python -m pip install -q -r bench/requirements.txt
	touch $@

# llama-tiny step and compile time: axplug, plain JAX and Flax NNX (1-3 minutes); the last
# line is `axplug/plain-jax step-time ratio: X.XXX`.
bench-quick: $(BENCH_STAMP)
	$(BIN)/python bench/step_time.py --quick

# Everything in bench/README.md on CPU (under ~10 minutes on 2 cores).
bench: $(BENCH_STAMP)
	$(BIN)/python bench/step_time.py
	$(BIN)/python bench/deep_stack.py
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/loc_complexity.py
	$(BIN)/python bench/decode.py
	$(BIN)/python bench/checkpoint_save.py
	$(BIN)/python bench/scaling.py

.PHONY: wheels
DIST ?= dist

# One wheel for the core and one per plugin in $(DIST)/, e.g. for
# `pip install --no-index --find-links dist axplug-moe` next to an installed core.
wheels:
	# A stale build/ would put since-deleted modules into the wheels.
	rm -rf build $(addsuffix /build,$(PLUGIN_DIRS))
	mkdir -p $(DIST) && rm -f $(DIST)/axplug*.whl
	$(PYTHON) -m pip wheel -q --no-deps -w $(DIST) . $(addprefix ./,$(PLUGIN_DIRS))
