# fastserve: the two commands a newcomer types are `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build kept on these machines; an unpinned torch would pull several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test test-variants install lint docs bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,cluster]"
	touch $@

install: $(VENV)/.installed

serve: install
	@echo "fastserve: serving the built-in tiny model at http://$(HOST):$(PORT)/v1"
	@echo "try: curl http://$(HOST):$(PORT)/v1/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"tiny\", \"prompt\": \"Hello\", \"max_tokens\": 16}'"
	$(VENV)/bin/fastserve serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q

# The tests that run the model, again on the other floating-point paths a machine may take, so
# that another kind of machine is not the first place a failure shows: the plain-torch path
# (FASTSERVE_CPU_KERNELS=0: no compiled -march=native attention kernels, no oneDNN-packed
# weights), then the model in bfloat16 (greedy tokens compared up to near-ties: tests/greedy.py).
# The server tests run too (their servers take the test dtype); the scheduler, simulator, fleet
# and benchmark tests run no model arithmetic of their own (they pass on both paths too).
VARIANT_TESTS ?= tests/executor tests/model tests/engine tests/distributed tests/server tests/test_*.py
test-variants: install
	FASTSERVE_CPU_KERNELS=0 $(PY) -m pytest -q $(VARIANT_TESTS)
	FASTSERVE_TEST_DTYPE=bfloat16 $(PY) -m pytest -q $(VARIANT_TESTS)

# Style, types, and the import layers (.importlinter: who may import whom, no cycles).
lint: install
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
