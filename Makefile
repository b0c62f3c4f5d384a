# The two commands of the README:
#   make run    install kvtier and run its main job: a small cluster on this machine (index,
#               two node stores, vLLM CPU instances, the router) and what it is for
#   make test   install everything the tests need and run the whole suite
# and the rest for working on it: `make help` lists every target.
VENV := .venv
DEPS := pyproject.toml scripts/install.sh scripts/vllm_dist_record.py $(wildcard requirements/*.txt)

.PHONY: help run test test-fast lint bench clean

$(VENV)/.core: $(DEPS)
	scripts/install.sh core
	touch $@

$(VENV)/.all: $(DEPS)
	scripts/install.sh all
	touch $(VENV)/.core $@

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-10s %s\n", $$1, $$2}' \
		$(firstword $(MAKEFILE_LIST))

run: $(VENV)/.all ## install kvtier and bring up a small cluster on this machine (kvtier demo)
	$(VENV)/bin/kvtier demo

# The tiers (CONTRIBUTING.md, "Tests"): tests/unit (no process started), tests/integration
# (real stores, index, Redis, transfer engine), tests/engine (real vLLM), tests/drills (faults
# through real processes), tests/gpu (skipped without CUDA).
# The tiers that start no vLLM engine run on two pytest-xdist workers, each module on one;
# then the engine tiers, alone and in order (tests/conftest.py says why).
test: $(VENV)/.all lint ## lint, type check and the whole suite, every tier (what CI runs)
	rc=0; \
	$(VENV)/bin/python -m pytest -n 2 --ignore=tests/engine --ignore=tests/drills || rc=1; \
	$(VENV)/bin/python -m pytest tests/engine tests/drills || rc=1; \
	exit $$rc

test-fast: $(VENV)/.all ## ruff and the unit tier: no process started, under a minute
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest tests/unit

# ruff (style, imports), mypy on every package (scripts/typecheck.py); the layering rule is a
# test (tests/unit/test_layering.py)
lint: $(VENV)/.all ## ruff (style, imports) and mypy on every package
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/python scripts/typecheck.py

# The microbenchmarks that need no vLLM and no GPU (~30 s); reports in results/bench/. The
# others, and how to read them: docs/benchmarks.md (kvtier bench --help).
bench: $(VENV)/.all ## the quick microbenchmarks: chunk keys, the DRAM pool, the KV copy
	mkdir -p results/bench
	$(VENV)/bin/kvtier bench keys --json results/bench/keys.json
	$(VENV)/bin/kvtier bench pool --json results/bench/pool.json
	$(VENV)/bin/kvtier bench kv-copy --json results/bench/kv-copy.json

clean: ## remove the environment and every build and tool cache
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache .typecheck
