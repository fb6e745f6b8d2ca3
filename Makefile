# The two commands of README.md:
#   make serve   install, prepare SmolLM2 + demo tenant/adapters, start the server and console
#   make test    install (incl. redis, postgresql, chromium), prepare SmolLM2, run the whole test suite
PYTHON ?= python3
export LORAPLEX_CACHE_DIR ?= $(CURDIR)/.cache
export LORAPLEX_DATA_DIR ?= $(CURDIR)/.cache/data
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install install-test demo-model serve test test-fast

install:
	bash scripts/install.sh

install-test:
	bash scripts/install.sh --test

demo-model:
	$(PYTHON) -m loraplex.cli models prepare smollm2

serve: install demo-model
	$(PYTHON) -m loraplex.cli demo up --host $(HOST) --port $(PORT)

test: install-test demo-model
	bash scripts/run_tests.sh $(PYTEST_ARGS)

# Without installs: the suite as it stands on this machine.
test-fast:
	bash scripts/run_tests.sh $(PYTEST_ARGS)
