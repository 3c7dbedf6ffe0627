# Two commands on a fresh machine:  make up  (run the stack)  /  make test  (run the tests)
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: up test lint install

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[train,megatron,eval,dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/clawrl up

test: $(STAMP)
	$(BIN)/ruff check proxy judge trainer tests
	$(BIN)/mypy
	$(BIN)/python -m pytest
