# The two commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that this machine carries; a plain `torch` would pull CUDA.
TORCH_SPEC ?= torch==2.13.0
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

serve: setup
	$(VENV)/bin/hkv-launch $(SERVE_ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
