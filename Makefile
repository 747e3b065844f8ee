# Every install step lives here: a fresh clone needs only `make train` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC ?= 2
# Extra overrides for `make train`, e.g. ARGS="--parallel.tensor_parallel_degree=2".
ARGS ?=

.PHONY: venv train test test-all bench chaos lint clean etcd

venv: $(STAMP)

# torch first, pinned exactly: that CPU wheel is on disk, any other spec pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,federated]"
	touch $(STAMP)

train: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/loomtrain train --config configs/shakespeare_char.toml --nproc $(NPROC) --overwrite $(ARGS)

test: $(STAMP) etcd
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -m "not slow" --durations=40

# etcd (Debian's etcd-server) for the rendezvous that survives any host's loss. Best effort:
# where apt cannot install it (not root, no Debian, no network) its tests skip with the reason.
etcd:
	command -v etcd >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		etcd-server) || echo "etcd not installed; its tests will skip (apt-get install etcd-server)"

test-all: $(STAMP) etcd
	OMP_NUM_THREADS=1 $(BIN)/pytest -q

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_default.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/cpu_time_default.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/profile_default.py --nproc 1
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/profile_default.py --nproc 2
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_dp.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_zero.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_compression.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_tp.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_pipeline.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_data.py

# Faults against clean runs; the host cases need root and etcd (skipped, with the reason, otherwise).
chaos: $(STAMP) etcd
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/chaos.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
