# The two README commands: `make demo` and `make test`. Both create .venv when it is missing.
# torch==2.13.0 is installed first and explicitly: its CPU build is on this machine's disk,
# while letting pip resolve a torch range pulls a CUDA build of several GB.
#
# The project's own environment is reproducible: every other package is installed at the
# version requirements/lock.txt pins (`make lock` refreshes it). The tests run on two torches:
# the floor pyproject.toml admits (.venv, torch 2.13.0 and requirements/lock.txt) and the
# newest release (.venv-newest, torch 2.15.0 and requirements/lock-newest.txt); `make test`
# runs the fast suite on both. Users of the library keep the version ranges of pyproject.toml;
# `make test-latest` runs the tests on the newest releases those ranges admit, torch included,
# in .venv-latest, so that a new release that breaks us shows up there instead of in a fresh
# clone.
#
# PyPI has no CPU build of torch 2.14 or later for Linux (download.pytorch.org, which has, is
# not reachable from this machine), so the newest torch is its CUDA build (about 6 GB in the
# venv); it runs on a CPU. This machine's pip caps torch at 2.14.1 through a global constraint
# file: PIP_CONSTRAINT=/dev/null lifts it for the commands that install the newest torch.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
TORCH  ?= torch==2.13.0
LOCK   ?= requirements/lock.txt
NEWEST       ?= .venv-newest
NEWEST_TORCH ?= torch==2.15.0
NEWEST_LOCK  ?= requirements/lock-newest.txt
NEWEST_PY    := $(NEWEST)/bin/python
NEWEST_STAMP := $(NEWEST)/.installed-stamp
UNCAPPED     := PIP_CONSTRAINT=/dev/null
PIP    := -m pip install --quiet --disable-pip-version-check
PYTEST_FLAGS ?=
# One thread per process unless set: on a small shared machine torch's default (a thread per
# core) made the demo 10x slower, and the tests run two ranks at a time.
export OMP_NUM_THREADS ?= 1

.PHONY: venv venv-newest demo test test-floor test-newest test-all test-avx2 test-latest lock \
	lock-newest lint bench docs clean

venv: $(STAMP)

venv-newest: $(NEWEST_STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP) $(TORCH)
	$(PY) $(PIP) -c $(LOCK) -e '.[all]'
	touch $(STAMP)

$(NEWEST_STAMP): pyproject.toml $(NEWEST_LOCK)
	test -x $(NEWEST_PY) || $(PYTHON) -m venv $(NEWEST)
	$(UNCAPPED) $(NEWEST_PY) $(PIP) -c $(NEWEST_LOCK) $(NEWEST_TORCH)
	$(UNCAPPED) $(NEWEST_PY) $(PIP) -c $(NEWEST_LOCK) -e '.[all]'
	touch $(NEWEST_STAMP)

demo: $(STAMP)
	$(PY) -m precision_annot demo

# The fast suite on the floor torch, then on the newest.
test: test-floor test-newest

# PA_EXPECT_TORCH: tests/test_seams.py fails where the venv holds another torch than named
test-floor: $(STAMP)
	$(PY) -c 'import torch; print("torch", torch.__version__)'
	PA_EXPECT_TORCH=$(TORCH) $(PY) -m pytest -q $(PYTEST_FLAGS)

test-newest: $(NEWEST_STAMP)
	$(NEWEST_PY) -c 'import torch; print("torch", torch.__version__)'
	PA_EXPECT_TORCH=$(NEWEST_TORCH) $(NEWEST_PY) -m pytest -q $(PYTEST_FLAGS)

test-all: $(STAMP) $(NEWEST_STAMP) test-avx2
	$(PY) -m pytest -q -m "" $(PYTEST_FLAGS)
	$(NEWEST_PY) -m pytest -q -m "" $(PYTEST_FLAGS)

# The tests again on the kernels of a CPU without AVX-512: ATen's (ATEN_CPU_CAPABILITY) and
# oneDNN's (ONEDNN_MAX_CPU_ISA; bf16 matrix multiplies go through it, and it reports no bf16
# support under AVX2, as such a CPU does). They round fp16 and bf16 ops differently from the
# AVX-512 ones, and a numeric test written on one CPU must hold on the other. Inductor keeps
# its compiled kernels in a cache of its own here: its default cache does not tell kernels
# built for AVX-512 from AVX2 ones, and one built for the other ISA reads only part of each
# tensor (the low-bit optimizer step, compiled, then trained to a loss of 2.06 instead of 0.79).
test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.inductor-avx2 \
	    $(PY) -m pytest -q $(PYTEST_FLAGS)

# The tests against the newest releases of every dependency, torch included (its CUDA build:
# the newest CPU build is not on PyPI). Every package is upgraded in one resolution, so torch
# stays what that resolution picks, and the versions that ran are printed first.
test-latest:
	test -x .venv-latest/bin/python || $(PYTHON) -m venv .venv-latest
	$(UNCAPPED) .venv-latest/bin/python $(PIP) --upgrade --upgrade-strategy eager torch -e '.[all]'
	.venv-latest/bin/python -m pip freeze --exclude-editable | \
		grep -iE '^(torch|torchao|triton|transformers|accelerate|lightning|deepspeed|bitsandbytes)=='
	.venv-latest/bin/python -m pytest -q $(PYTEST_FLAGS)

# Refresh the locks: resolve pyproject's ranges afresh in a scratch venv and pin what came,
# once over the floor torch and once over the newest.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python $(PIP) $(TORCH)
	.venv-lock/bin/python $(PIP) -e '.[all]'
	mkdir -p requirements
	{ echo "# Pins for the project's own environment (tests, CI, demo): make installs $(TORCH)"; \
	  echo "# first, then the project with these constraints. Refresh with 'make lock'."; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > $(LOCK)
	rm -rf .venv-lock
	@echo "wrote $(LOCK); run 'make test' on it before committing"

# The newest torch over the floor lock's other pins: the two suites differ only in torch (and
# what it brings: triton, CUDA libraries). `make test-latest` takes the newest of everything.
lock-newest:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	$(UNCAPPED) .venv-lock/bin/python $(PIP) $(NEWEST_TORCH)
	$(UNCAPPED) .venv-lock/bin/python $(PIP) -c $(LOCK) -e '.[all]'
	mkdir -p requirements
	{ echo "# Pins for the tests on the newest torch (make test-newest): $(NEWEST_TORCH) (its CUDA"; \
	  echo "# build: PyPI has no newer CPU build) over lock.txt's other pins. Refresh with"; \
	  echo "# 'make lock-newest' after 'make lock'."; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable; } > $(NEWEST_LOCK)
	rm -rf .venv-lock
	@echo "wrote $(NEWEST_LOCK); run 'make test-newest' on it before committing"

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy --strict precision_annot
	$(PY) tools/complexity.py

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) $(NEWEST) .venv-latest site .pytest_cache .mypy_cache .ruff_cache .torch_extensions \
	    .inductor-avx2
