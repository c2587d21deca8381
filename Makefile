# The front door. Every target is one line that calls Python (through uv, which installs on first use).
RECIPE  ?= llama3_70b_pretrain_64gpu_h100_bf16
NODES   ?=
SET     ?=
FORMAT  ?= text
UV      ?= tools/uv.sh
PY      := $(UV) run --frozen --quiet python
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup test lint recipes plan bench

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: ## install the pinned stack into .venv (uv sync --frozen)
	$(UV) sync --frozen

test: ## run the test suite (one pytest process; Bridge is imported once)
	$(PY) -m pytest tests $(PYTEST_ARGS)

lint: ## ruff check + format check
	$(UV) run --frozen --quiet ruff check . && $(UV) run --frozen --quiet ruff format --check .

recipes: ## list every recipe: model, GPUs, dtype, layout, overlap summary
	$(PY) -m launch.plan --list

plan: ## the main job: build RECIPE, apply SET/NODES, resolve + audit the overlap stack, write runs/<dir>
	$(PY) -m launch.plan $(RECIPE) --nodes "$(NODES)" --set "$(SET)" --format $(FORMAT)

bench: ## plan-all time vs bare `import megatron.bridge`, measured side by side
	$(PY) bench/plan_all.py
