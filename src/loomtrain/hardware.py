"""Peak dense matmul throughput of a device, and model FLOP utilisation (MFU).

MFU is the achieved model FLOP/s divided by the device's peak (Chowdhery et al., "PaLM" 2022,
Appendix B). The peak of a known GPU comes from its vendor's datasheet; a CPU, or a GPU not in
the table, is measured once with a matmul benchmark and the result cached on disk.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch


class GpuPeak(NamedTuple):
    """Dense (no 2:4 sparsity) tensor throughput in TFLOP/s; ``tf32`` is fp32 inputs on tensor cores."""

    bf16: float
    fp16: float
    tf32: float
    fp32: float


# Matched in order against torch.cuda.get_device_name(); a more specific name comes before any
# name it contains ("H100 PCIe" before "H100", "L40S" before "L40" before "L4").
# Datasheets list sparse figures too; these are the dense ones (half the sparse figure).
GPU_PEAKS: tuple[tuple[str, GpuPeak], ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet (PCIe, NVL and SXM columns).
    ("H100 PCIe", GpuPeak(756.0, 756.0, 378.0, 51.0)),
    ("H100 NVL", GpuPeak(835.5, 835.5, 417.5, 60.0)),
    ("H100", GpuPeak(989.4, 989.4, 494.7, 67.0)),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 NVL and H200 SXM columns).
    ("H200 NVL", GpuPeak(835.5, 835.5, 417.5, 60.0)),
    ("H200", GpuPeak(989.4, 989.4, 494.7, 67.0)),
    # NVIDIA H800 Tensor Core GPU datasheet (PCIe and SXM columns).
    ("H800 PCIe", GpuPeak(756.0, 756.0, 378.0, 51.0)),
    ("H800", GpuPeak(989.4, 989.4, 494.7, 67.0)),
    # NVIDIA A100 Tensor Core GPU datasheet (same for 40 and 80 GB, PCIe and SXM).
    ("A100", GpuPeak(312.0, 312.0, 156.0, 19.5)),
    # NVIDIA A10G has no datasheet of its own (it is AWS's variant); NVIDIA A10 datasheet figures.
    ("A10G", GpuPeak(125.0, 125.0, 62.5, 31.2)),
    ("A10", GpuPeak(125.0, 125.0, 62.5, 31.2)),
    # NVIDIA L40S datasheet; NVIDIA L40 datasheet; NVIDIA L4 Tensor Core GPU datasheet.
    ("L40S", GpuPeak(362.05, 362.05, 183.0, 91.6)),
    ("L40", GpuPeak(181.05, 181.05, 90.5, 90.5)),
    ("L4", GpuPeak(121.0, 121.0, 60.0, 30.3)),
    # NVIDIA Tesla V100 datasheet (SXM2 and PCIe). Volta has no bf16 or tf32 tensor cores:
    # bf16 and fp32 run on the fp32 units.
    ("V100-PCIE", GpuPeak(14.0, 112.0, 14.0, 14.0)),
    ("V100", GpuPeak(15.7, 125.0, 15.7, 15.7)),
    # NVIDIA Ada Lovelace GPU architecture whitepaper, Appendix A (RTX 4090): fp16/bf16 with
    # fp32 accumulate, as PyTorch's matmuls use.
    ("RTX 4090", GpuPeak(165.2, 165.2, 82.6, 82.6)),
    # NVIDIA Ampere GA102 GPU architecture whitepaper, Appendix A (RTX 3090): fp32 accumulate.
    ("RTX 3090", GpuPeak(71.0, 71.0, 35.6, 35.6)),
    # AMD Instinct MI300X accelerator datasheet (fp32 is the matrix-core figure).
    ("MI300X", GpuPeak(1307.4, 1307.4, 653.7, 163.4)),
)

BENCH_MIN_SECONDS = 0.01
BENCH_MAX_SIZE = 8192
BENCH_WARMUP = 2
BENCH_REPEATS = 5


def gpu_peak_flops_per_s(name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """Datasheet peak of the GPU called ``name`` (as ``torch.cuda.get_device_name`` gives it).

    Args:
        dtype: matmul input dtype.
        tf32: float32 matmuls run on tensor cores in TF32 (``torch.get_float32_matmul_precision``
            is not ``"highest"``).

    Returns:
        FLOP/s, or ``None`` for a GPU or dtype not in :data:`GPU_PEAKS`.
    """
    for key, peak in GPU_PEAKS:
        if key.lower() in name.lower():
            by_dtype = {
                torch.bfloat16: peak.bf16,
                torch.float16: peak.fp16,
                torch.float32: peak.tf32 if tf32 else peak.fp32,
            }
            tflops = by_dtype.get(dtype)
            return None if tflops is None else tflops * 1e12
    return None


def peak_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    """Peak dense matmul throughput of one ``device`` for inputs of ``dtype``, in FLOP/s.

    CUDA/ROCm GPUs in :data:`GPU_PEAKS` get their datasheet figure. Any other device (a CPU,
    an unknown GPU, with a warning for the latter) is measured once with square matmuls in
    the current process's thread count, and the figure is cached in a JSON file
    (``$LOOMTRAIN_CACHE_DIR/peak_flops.json``, default ``~/.cache/loomtrain``) keyed by device
    name, torch version, dtype and thread count. A measured peak is what this process can
    reach, not the chip's theoretical peak, so MFU against it reads higher.
    """
    device = torch.device(device)
    name = device_name(device)
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        known = gpu_peak_flops_per_s(name, dtype, tf32)
        if known is not None:
            return known
        warnings.warn(
            f"no datasheet peak for GPU {name!r} in {dtype}; measuring it, add it to "
            "loomtrain.hardware.GPU_PEAKS for a true MFU",
            stacklevel=2,
        )
    key = f"{name}|torch={torch.__version__}|{dtype}|threads={torch.get_num_threads()}"
    path = cache_path()
    cached = _read_cache(path).get(key)
    if cached is not None:
        return float(cached)
    measured = measure_matmul_flops_per_s(device, dtype)
    _write_cache(path, key, measured)
    return measured


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOP utilisation: ``flops_per_token × tokens_per_s / peak_flops_per_s``.

    Args:
        flops_per_token: training FLOP per token (:func:`loomtrain.models.flops.flops_per_token`).
        tokens_per_s: tokens per second processed by one device.
        peak_flops_per_s: that device's peak, FLOP/s (:func:`peak_flops_per_s`).

    Returns:
        A fraction, 0..1 for a correct peak.

    Raises:
        ValueError: ``peak_flops_per_s`` is not positive.
    """
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s={peak_flops_per_s} must be > 0")
    return flops_per_token * tokens_per_s / peak_flops_per_s


def device_name(device: torch.device) -> str:
    """Model name of ``device``: the GPU's name, or the CPU's from /proc/cpuinfo or ``platform``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cache_path() -> Path:
    """The measured-peak cache: ``$LOOMTRAIN_CACHE_DIR/peak_flops.json`` or ``~/.cache/loomtrain/...``."""
    root = os.environ.get("LOOMTRAIN_CACHE_DIR") or Path.home() / ".cache" / "loomtrain"
    return Path(root) / "peak_flops.json"


def measure_matmul_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    """Best FLOP/s of ``n × n`` matmuls in ``dtype`` on ``device``.

    ``n`` doubles from 256 until one matmul takes at least 10 ms (or ``n`` reaches 8192), so
    that the measurement is not dominated by overheads on a fast device nor takes seconds on
    a slow one; then the best of 5 timed repeats after 2 warm-ups is kept. Counts ``2·n³``
    FLOP per matmul. Takes well under a second on a CPU.
    """
    n = 256
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = _time_matmul(a, b, BENCH_WARMUP if n == 256 else 1, 1)
        if seconds >= BENCH_MIN_SECONDS or n >= BENCH_MAX_SIZE:
            break
        n *= 2
    best = _time_matmul(a, b, 0, BENCH_REPEATS)
    return 2 * n**3 / best


def _time_matmul(a: torch.Tensor, b: torch.Tensor, warmup: int, repeats: int) -> float:
    """Fastest of ``repeats`` timed ``a @ b``, in seconds, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        torch.matmul(a, b)
    synchronize(a.device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        synchronize(a.device)
        best = min(best, time.perf_counter() - start)
    return best


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU): before reading a clock."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _read_cache(path: Path) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, value: float) -> None:
    """Add ``key`` to the cache; written to a temporary file and renamed so that ranks writing
    at once never leave a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = _read_cache(path) | {key: value}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".peak_flops.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
