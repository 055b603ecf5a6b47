# One command sets up and tests from a clean clone: `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)
DATA ?= ../shared/data/commonsense

.PHONY: test install lint format demo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# best effort: headless Chromium for tests/test_report_html.py (root with apt-get only)
	-if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromium >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		>/dev/null 2>&1 || echo "chromium not installed: its report test will skip"; fi
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench tools research
	$(BIN)/ruff format --check src tests bench tools research

format: $(STAMP)
	$(BIN)/ruff format src tests bench tools research
	$(BIN)/ruff check --fix src tests bench tools research

test: lint
	# two workers (the 2-core CI); tests that start Flower, Ray or kill processes share one
	# worker, one after another (tests/conftest.py: the "processes" group)
	FEDLORA_DATA=$(DATA) HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup

demo: $(STAMP)
	FEDLORA_DATA=$(DATA) $(BIN)/fedlora run --config configs/demo.toml

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
