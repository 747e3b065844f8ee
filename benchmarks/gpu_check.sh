#!/usr/bin/env bash
# The one prepared script for a session that is lent a GPU (docs: the developers' guide).
# Runs the CUDA/NCCL paths that CI cannot (bf16 autocast, ZeRO 1-3 with bf16 parameters, the
# flash SDPA kernel) and the single-GPU MFU of a realistic model, then the pipeline bubble
# benchmark on the host's CPU cores (gloo, one core per pipeline rank, which the 2-core
# development machine cannot give pp = 4: issue #5's 3-point target); writes everything under
# ${OUT:-benchmarks/results/gpu} with the date and the card, to be kept in benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
py="${PYTHON:-python}"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$py" -c "import torch; print(torch.__version__, torch.version.cuda)"; } > "$out/machine.txt" 2>&1
"$py" -m pytest -q tests/integration/test_train_variants.py -k cuda > "$out/cuda_tests.txt" 2>&1
echo "cuda tests: exit $?" >> "$out/machine.txt"
"$py" benchmarks/bench_mfu.py --device cuda --out "$out/mfu_16x2048.json" > "$out/mfu_16x2048.txt" 2>&1
"$py" benchmarks/bench_mfu.py --device cuda --layers 24 --dim 1024 --heads 16 --batch 16 --out "$out/mfu_24x1024.json" \
    > "$out/mfu_24x1024.txt" 2>&1
OMP_NUM_THREADS=1 "$py" benchmarks/bench_pipeline.py --out "$out/pipeline_cpu.json" > "$out/pipeline_cpu.txt" 2>&1
cat "$out"/*.txt
