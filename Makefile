# make demo: set up .venv and run the main job.  make test: lint, type-check and test (the slow tests:
# make test-all).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PIP_CONSTRAINT := $(CURDIR)/.ci/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-all lint docs bench fuzz clean

$(STAMP): pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m specvit.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check specvit tests
	$(VENV)/bin/ruff format --check specvit tests
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q -n 2 -m "not slow"

test-all: lint
	$(VENV)/bin/pytest -q -n 2

docs: $(STAMP)
	$(PY) -m specvit.docs
	$(PY) -m specvit.diagram.gallery
	$(PY) tests/robustness_cases.py

bench: $(STAMP)
	$(PY) -m benchmarks

FUZZ_SECONDS ?= 60

fuzz: $(STAMP)
	$(PY) -m pip install -q 'atheris>=2.3'
	$(PY) tests/fuzz_parse_spec.py -max_total_time=$(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) build
