# The two commands a fresh machine needs: `make test` and `make train`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Which torch to install into a fresh venv; CI passes the CPU build it has on disk.
TORCH_SPEC ?= torch
PYTEST_WORKERS ?= 2

.PHONY: install test test-gpu lint train report clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,examples,hf]"

test: install
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS)

test-gpu: install
	$(VENV)/bin/pytest -q -m gpu

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

train: install
	$(PY) examples/train_gpt.py

# BENCHMARKS.md and docs/img/ from the runs in bench/ (python -m fusedlayers.bench report).
report: install
	$(PY) -m fusedlayers.bench report

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
