# The two README commands: `make demo` and `make test`. Both create .venv when it is missing.
# torch==2.13.0 is installed first and explicitly: its CPU build is on this machine's disk,
# while letting pip resolve a torch range pulls a CUDA build of several GB.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
TORCH  ?= torch==2.13.0
PYTEST_FLAGS ?=
# One thread per process unless set: on a small shared machine torch's default (a thread per
# core) made the demo 10x slower, and the tests run two ranks at a time.
export OMP_NUM_THREADS ?= 1

.PHONY: venv demo test test-all lint bench docs clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[all]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m precision_annot demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_FLAGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "" $(PYTEST_FLAGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy --strict precision_annot

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .torch_extensions
