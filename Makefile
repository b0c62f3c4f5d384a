# The two commands of the README:
#   make run    install kvtier and run its main job on embedded defaults
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

run: $(VENV)/.core
	$(VENV)/bin/kvtier demo

test: $(VENV)/.all
	$(VENV)/bin/python -m pytest

lint: $(VENV)/.all
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
