# Every install step lives here: a fresh clone needs only `make train` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC ?= 2
# Extra overrides for `make train`, e.g. ARGS="--parallel.tensor_parallel_degree=2".
ARGS ?=

.PHONY: venv train test test-all bench lint clean

venv: $(STAMP)

# torch first, pinned exactly: that CPU wheel is on disk, any other spec pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/loomtrain train --config configs/shakespeare_char.toml --nproc $(NPROC) --overwrite $(ARGS)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -m "not slow" --durations=15

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/pytest -q

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_dp.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_zero.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_compression.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_tp.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_pipeline.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_data.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
