# Two set-up commands: `make test` and `make demo`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test test-fast install demo demo-smoke bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev,demo]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q tests

test-fast: $(STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info
