# Two commands do all set-up on a fresh machine:
#   make serve   -> environment + install + the 1-prefill/1-decode cluster on the embedded model
#   make test    -> environment + install + the whole test suite
VENV := .venv
PY := $(VENV)/bin/python
PDSERVE := $(VENV)/bin/pdserve
# test files run on this many processes (pytest-xdist; 0: one process). Each file stays on one
# process (--dist loadfile): a module's shared cluster and its tests' order stay as written.
TEST_WORKERS ?= 2

.PHONY: setup serve demo test bench

setup:
	bash scripts/setup.sh

serve: setup
	$(PDSERVE) serve

demo: setup
	$(PDSERVE) demo

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

bench: setup
	$(PDSERVE) bench-engine --model small
	$(PDSERVE) bench-transfer
