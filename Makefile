# The two commands of the README:
#   make run    install kvtier and run its main job: a small cluster on this machine (index,
#               two node stores, vLLM CPU instances, the router) and what it is for
#   make test   install everything the tests need and run the whole suite
VENV := .venv
DEPS := pyproject.toml scripts/install.sh $(wildcard requirements/*.txt)

.PHONY: run test lint bench clean

$(VENV)/.core: $(DEPS)
	scripts/install.sh core
	touch $@

$(VENV)/.all: $(DEPS)
	scripts/install.sh all
	touch $(VENV)/.core $@

run: $(VENV)/.all
	$(VENV)/bin/kvtier demo

test: $(VENV)/.all lint
	$(VENV)/bin/python -m pytest

# ruff (style, imports), mypy on every package (scripts/typecheck.py); the layering rule is a
# test (tests/test_layering.py)
lint: $(VENV)/.all
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/python scripts/typecheck.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache .typecheck
