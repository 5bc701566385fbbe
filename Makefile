# Alloy: two commands. `make demo` runs the main job, `make test` runs the whole suite.
# Both set everything up first (idempotent: a second run only checks a stamp).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.alloy-setup-stamp
CONFIG  ?= configs/demo.yaml
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` (0: the plain serial run, in collection order); tests/conftest.py groups them
TEST_WORKERS ?= 2

.PHONY: setup demo dataset-example agentic smoke test test-unit bench clean-runs

setup: $(STAMP)

# scripts/install.py: torch's CPU wheel first (anything that depends on torch would otherwise pull a multi-GB CUDA
# build), then the package; constraints.txt pins the set known to resolve here; every module byte-compiled. With uv
# when it can be had (from the index pip uses, with pip's settings), else pip.
$(STAMP): pyproject.toml constraints.txt scripts/install.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python scripts/install.py $(VENV)
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) || \
	  echo "note: chromium not installed; browser tests will be skipped"; }
	touch $(STAMP)

demo: setup
	$(BIN)/alloy run $(CONFIG) --report runs/demo-report.json

# Dataset domains on a Qwen2 + byte-level BPE checkpoint (configs/dataset-example.yaml): make the data and the
# checkpoint under runs/dataset-example/, then run the pipeline on them.
dataset-example: setup
	$(BIN)/python scripts/make_datasets.py runs/dataset-example/data
	test -f runs/dataset-example/model/config.json || $(BIN)/alloy model init --out runs/dataset-example/model --preset tiny \
	  --arch qwen2 --tokenizer bpe --train-text runs/dataset-example/data/corpus.txt
	$(BIN)/alloy run configs/dataset-example.yaml --report runs/dataset-example/report.json

# Tool-use domains with the guard and a served judge model (configs/agentic.yaml): train the judge once, then run.
agentic: setup
	test -f runs/agentic/judge/config.json || $(BIN)/python -m teachers.judge_model runs/agentic/judge
	$(BIN)/alloy run configs/agentic.yaml --report runs/agentic/report.json

smoke: setup
	$(BIN)/alloy run configs/smoke.yaml --report runs/smoke-report.json

test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/python -m pytest -m unit $(PYTEST_ARGS)

# Tests write screenshots to a temp folder (the tree stays clean); this refreshes the README's images in docs/img.
.PHONY: screenshots
screenshots: setup
	ALLOY_SCREENSHOTS_DIR=docs/img $(BIN)/python -m pytest tests/e2e/test_browser.py $(PYTEST_ARGS)

# docs/config.md is generated from the field descriptions of infra/config_shared.py and infra/config_stages.py (the
# sections infra/config.py re-exports; a unit test checks it is current).
.PHONY: config-docs
config-docs: setup
	$(BIN)/python scripts/gen_config_docs.py

clean-runs:
	rm -rf runs
