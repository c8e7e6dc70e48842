# Two set-up commands: `make demo` and `make test`. Both create .venv with the CPU build of torch if it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e '.[dev,plots,transformers,models,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/onlineattn demo

test: $(STAMP)
	$(PY) -m pytest -q src tests

clean:
	rm -rf $(VENV) build src/*.egg-info
