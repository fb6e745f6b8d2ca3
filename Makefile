# The two commands of README.md:
#   make serve   install, prepare SmolLM2 + demo tenant/adapters, start the server and console
#   make test    install (incl. redis, postgresql, chromium), prepare SmolLM2, run the whole test suite
# Everything Python lives in the virtual environment .venv (created by scripts/install.sh from
# $(PYTHON), a stock distribution Python is fine).
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
export LORAPLEX_VENV := $(VENV)
export LORAPLEX_CACHE_DIR ?= $(CURDIR)/.cache
export LORAPLEX_DATA_DIR ?= $(CURDIR)/.cache/data
HOST ?= $(or $(LORAPLEX_HOST),127.0.0.1)
PORT ?= $(or $(LORAPLEX_PORT),8000)
PYTEST_ARGS ?=

.PHONY: install install-test demo-model serve test test-fast

install:
	PYTHON=$(PYTHON) bash scripts/install.sh

install-test:
	PYTHON=$(PYTHON) bash scripts/install.sh --test

demo-model:
	$(VPY) -m loraplex.cli models prepare smollm2

serve: install demo-model
	$(VPY) -m loraplex.cli demo up --host $(HOST) --port $(PORT)

test: install-test demo-model
	PYTHON=$(VPY) bash scripts/run_tests.sh $(PYTEST_ARGS)

# Without installs: the suite as it stands on this machine.
test-fast:
	PYTHON=$(VPY) bash scripts/run_tests.sh $(PYTEST_ARGS)
