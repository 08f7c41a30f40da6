# The README's two commands: `make demo` and `make test`. Each sets up .venv on first use.
SHELL := /bin/bash
VENV ?= .venv
export STOA_VENV := $(VENV)

.PHONY: demo test setup
setup:
	@scripts/setup.sh

# The demo needs no real-model fixture and no verifiers (only the tests use them): setup skips both here.
demo:
	@STOA_SKIP_REAL_MODEL=1 STOA_SKIP_VERIFIERS=1 scripts/setup.sh
	@. scripts/env.sh && $(VENV)/bin/stoa train examples/papersearch_tiny.toml

test: setup
	@scripts/test.sh
