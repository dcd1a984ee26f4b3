# fastserve: the two commands a newcomer types are `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build kept on these machines; an unpinned torch would pull several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test test-variants test-wheel install install-dev build-kernels lint docs bench clean

# What serving needs, and nothing else: the package (editable) and torch. The CPU kernels are
# built here, once, with a line saying so, so that no first request waits for them.
$(VENV)/.installed: pyproject.toml
	@echo "fastserve: installing torch and the package into $(VENV) (once; a minute or two)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	$(VENV)/bin/fastserve build-kernels
	touch $@

# The tests' tools and the fleet (Ray Serve) on top.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test,cluster]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# Again after a change to the kernels' sources (a no-op when they are built).
build-kernels: install
	$(VENV)/bin/fastserve build-kernels

serve: install
	@echo "fastserve: serving the built-in tiny model at http://$(HOST):$(PORT)/v1"
	@echo "try: curl http://$(HOST):$(PORT)/v1/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"tiny\", \"prompt\": \"Hello\", \"max_tokens\": 16}'"
	$(VENV)/bin/fastserve serve --host $(HOST) --port $(PORT)

# The kernels are built before pytest starts (tests/conftest.py does it too, for a bare pytest).
test: install-dev build-kernels
	$(PY) -m pytest -q

# The package as a user gets it: a wheel built from this tree, installed into a fresh virtual
# environment (no editable install, no FASTSERVE_* variables), serving a completion and a chat
# on the CPU kernels. Minutes (a venv, an install, a kernel build), so not part of `make test`.
test-wheel:
	.ci/test-wheel

# The tests that run the model, again on the other floating-point paths a machine may take, so
# that another kind of machine is not the first place a failure shows: the plain-torch path
# (FASTSERVE_CPU_KERNELS=0: no compiled -march=native attention kernels, no oneDNN-packed
# weights), then the model in bfloat16 (greedy tokens compared up to near-ties: tests/greedy.py).
# The server tests run too (their servers take the test dtype); the scheduler, simulator, fleet
# and benchmark tests run no model arithmetic of their own (they pass on both paths too).
VARIANT_TESTS ?= tests/executor tests/model tests/engine tests/distributed tests/server tests/test_*.py
test-variants: install-dev build-kernels
	FASTSERVE_CPU_KERNELS=0 $(PY) -m pytest -q $(VARIANT_TESTS)
	FASTSERVE_TEST_DTYPE=bfloat16 $(PY) -m pytest -q $(VARIANT_TESTS)

# Style, types, and the import layers (.importlinter: who may import whom, no cycles).
lint: install-dev
	$(VENV)/bin/ruff check fastserve tests benchmarks
	$(VENV)/bin/mypy fastserve
	$(VENV)/bin/lint-imports --no-cache

# The documentation site (mkdocs.yml, docs/), strict: a broken link or anchor fails the build.
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache site
