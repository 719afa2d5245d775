# The README's two commands: `make demo` (the main job) and `make test` (everything CI runs).
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: bootstrap controller lint unit fuzz test demo demo-down clean

bootstrap:
	@scripts/bootstrap.sh

# Only what running the playbooks against your own hosts needs, without root: .venv with the package and
# ansible-core (no host packages, no test tools). `make bootstrap` later adds those.
controller:
	$${KIMI_PYTHON:-python3} -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[controller]'

lint: bootstrap
	$(BIN)/ruff check kimi_service tests scripts bench
	$(BIN)/yamllint --strict .
	$(BIN)/ansible-playbook --syntax-check site.yml
	$(BIN)/ansible-lint --offline -q

unit: bootstrap
	$(BIN)/python -m pytest -m "not slow"

# The generated-input layer (tests/unit/fuzz) at length: thousands of inputs per entry point, no deadline.
fuzz: bootstrap
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest tests/unit/fuzz -p no:cacheprovider

# Three workers on the two cores, a module per worker at a time (its hosts and engine are module fixtures),
# in the order tests/conftest.py collects them (longest first), not xdist's own (most tests first). With
# two, the CPUs idled a fifth of the run (boots, SSH round trips, waits on services); the third worker's
# engines float instead of taking a core (tests/support/cpu_site.py, engine_env).
test: lint
	$(BIN)/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=20

demo: bootstrap
	$(BIN)/python scripts/demo.py up

demo-down: bootstrap
	$(BIN)/python scripts/demo.py down

clean: demo-down
	rm -rf $(VENV) .pytest_cache .ruff_cache
