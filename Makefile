# The README's two commands: `make demo` and `make test`. Each sets up .venv on first use.
SHELL := /bin/bash
VENV ?= .venv
export STOA_VENV := $(VENV)

.PHONY: demo test setup
setup:
	@scripts/setup.sh

demo: setup
	@. scripts/env.sh && $(VENV)/bin/stoa train examples/papersearch_tiny.toml

test: setup
	@scripts/test.sh
