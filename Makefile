# The README's two commands: `make demo` and `make test`. Each sets up .venv on first use.
SHELL := /bin/bash
VENV ?= .venv
export STOA_VENV := $(VENV)

.PHONY: demo test setup
setup:
	@scripts/setup.sh

# The demo needs no real-model fixture (only the tests use it): setup skips building it here.
demo:
	@STOA_SKIP_REAL_MODEL=1 scripts/setup.sh
	@. scripts/env.sh && $(VENV)/bin/stoa train examples/papersearch_tiny.toml

test: setup
	@scripts/test.sh
