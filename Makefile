# `make train` and `make test` each build .venv on their own (Python 3.12 from PATH or pyenv).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

PYTHON312 := $(shell bash tools/find_python312.sh)

.PHONY: venv train test test-gpu bench clean

$(STAMP): requirements.txt
	@if [ -z "$(PYTHON312)" ] || ! "$(PYTHON312)" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then \
	  echo "error: Python 3.12 not found on PATH or through pyenv; install it (e.g. 'pyenv install 3.12')" >&2; exit 1; fi
	@[ -x $(PY) ] || "$(PYTHON312)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	@touch $(STAMP)

venv: $(STAMP)

# The main job: train the tiny hybrid on synthetic recall data on CPU, then evaluate it.
TRAIN_DIR ?= workdirs/tiny
train: $(STAMP)
	$(PY) train.py --config configs/tiny.py --workdir $(TRAIN_DIR)
	$(PY) eval.py --config configs/tiny.py --workdir $(TRAIN_DIR)

test: $(STAMP)
	$(PY) -m pytest -q tests -n 2 --dist loadfile --durations=10

test-gpu: $(STAMP)
	JAX_PLATFORMS=cuda $(PY) -m pytest -q tests -m gpu

bench: $(STAMP)
	$(PY) benchmarks/kda.py

clean:
	rm -rf $(VENV) .pytest_cache
