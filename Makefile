# fastserve: the two commands a newcomer types are `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build kept on these machines; an unpinned torch would pull several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test install lint bench clean

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

# Style, types, and the import layers (.importlinter: who may import whom, no cycles).
lint: install
	$(VENV)/bin/ruff check fastserve tests benchmarks
	$(VENV)/bin/mypy fastserve
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) .pytest_cache
