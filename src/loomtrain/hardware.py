"""Peak dense matmul throughput of a device, and model FLOP utilisation (MFU).

MFU is the achieved model FLOP/s divided by the device's peak (Chowdhery et al., "PaLM" 2022,
Appendix B). The peak of a known GPU comes from its vendor's datasheet; a CPU, or a GPU not in
the table, is measured with a matmul benchmark (best of many short tries that ran undisturbed),
cached on disk for :data:`CACHE_MAX_AGE_DAYS` days and, on a CPU, checked against the cores'
theoretical FMA peak (:func:`cpu_fma_bound`). :class:`Peak` says which figure was used and why.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import torch

from loomtrain.cache import cache_dir, write_atomic


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

# A measured peak is re-measured after this many days (a new kernel, BIOS or host may change it).
CACHE_MAX_AGE_DAYS = 30
# Short tries fit between the scheduler's preemptions of a shared core: on this project's 2-core VM
# under load, ~60 % of 3 ms tries ran undisturbed against 1 in 22 of 25 ms tries.
BENCH_MIN_SECONDS = 0.002
BENCH_MAX_SIZE = 8192
BENCH_BUDGET_S = 0.5
BENCH_MIN_TRIES = 5
# A try whose threads held their cores for this share of its wall time ran undisturbed.
UNDISTURBED_SHARE = 0.95
# A measured figure below this fraction of the FMA bound is not a peak: a loaded machine or a slow kernel.
IMPLAUSIBLY_LOW = 0.25
# A doubtful measurement below this fraction of an earlier cached figure does not replace it.
FAR_BELOW = 0.8


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


class FmaBound(NamedTuple):
    """Theoretical fp32 peak of the cores one process computes on: cores × clock × FLOP/cycle.

    Attributes:
        flops_per_s: FLOP/s, or ``None`` where it cannot be derived (``basis`` says why).
        basis: how it was derived (cores, clock and its source, FLOP/cycle and the unit), or why not.
        at_max_clock: the clock is the cpufreq maximum (a true upper bound); False: the clock
            /proc/cpuinfo reports, which a boost may exceed (a virtual machine shows no maximum).
    """

    flops_per_s: float | None
    basis: str
    at_max_clock: bool = False


class Measurement(NamedTuple):
    """A matmul benchmark: best FLOP/s, and whether it came from a try that ran undisturbed."""

    flops_per_s: float
    undisturbed: bool
    tries: int


class CacheEntry(NamedTuple):
    """A cached measured peak: FLOP/s and when it was measured (UTC ISO 8601; None: unknown)."""

    flops_per_s: float
    measured_at: str | None


class Peak(NamedTuple):
    """The peak MFU is computed against and where it came from.

    Attributes:
        flops_per_s: FLOP/s.
        source: ``"datasheet"`` (a known GPU), ``"measured"`` (by this process, now) or
            ``"cached"`` (measured earlier, read from :func:`cache_path`).
        measured_at: UTC ISO 8601 time of the measurement (None for a datasheet figure).
        bound: the CPU's theoretical FMA peak (None off the CPU).
        note: why a figure was not cached, kept or capped; empty otherwise.
    """

    flops_per_s: float
    source: str
    measured_at: str | None = None
    bound: FmaBound | None = None
    note: str = ""

    def describe(self) -> str:
        """One line: ``85.4 GFLOP/s (measured 2025-06-01; FMA bound 78.3 GFLOP/s: …)``."""
        when = f" {self.measured_at[:10]}" if self.measured_at else ""
        parts = [f"{self.source}{when}"]
        if self.bound is not None:
            figure = "not derived" if self.bound.flops_per_s is None else f"{self.bound.flops_per_s / 1e9:.1f} GFLOP/s"
            parts.append(f"FMA bound {figure}: {self.bound.basis}")
        if self.note:
            parts.append(self.note)
        return f"{self.flops_per_s / 1e9:.1f} GFLOP/s ({'; '.join(parts)})"

    def as_dict(self) -> dict:
        """For ``summary.json``: source, measured_at, the bound and its basis, the note."""
        bound = self.bound or FmaBound(None, "no FMA bound off the CPU")
        return {"source": self.source, "measured_at": self.measured_at, "fma_bound_flops_per_s": bound.flops_per_s,
                "fma_bound_basis": bound.basis, "note": self.note}  # fmt: skip


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    """Peak dense matmul throughput of one ``device`` for inputs of ``dtype``, and its source.

    CUDA/ROCm GPUs in :data:`GPU_PEAKS` get their datasheet figure. Any other device (a CPU,
    an unknown GPU, with a warning for the latter) is measured (:func:`measure_matmul_peak`) in
    the current process's thread count and cached in ``$LOOMTRAIN_CACHE_DIR/peak_flops.json``
    (default ``~/.cache/loomtrain``), keyed by device name, torch version, dtype and thread
    count, for :data:`CACHE_MAX_AGE_DAYS`; :func:`settle` decides what a new measurement
    replaces. A measured peak is what this process can reach, not the chip's theoretical peak,
    so MFU against it reads higher; on a CPU the theoretical FMA peak (:func:`cpu_fma_bound`)
    bounds it.
    """
    device = torch.device(device)
    name = device_name(device)
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        known = gpu_peak_flops_per_s(name, dtype, tf32)
        if known is not None:
            return Peak(known, "datasheet")
        warnings.warn(
            f"no datasheet peak for GPU {name!r} in {dtype}; measuring it, add it to "
            "loomtrain.hardware.GPU_PEAKS for a true MFU",
            stacklevel=2,
        )
    key = cache_key(name, dtype)
    path, now = cache_path(), datetime.now(UTC)
    bound = cpu_fma_bound(dtype, torch.get_num_threads()) if device.type == "cpu" else None
    previous = _read_cache(path).get(key)
    if previous is not None and is_fresh(previous, now):
        return Peak(previous.flops_per_s, "cached", previous.measured_at, bound)
    peak, keep = settle(previous, measure_matmul_peak(device, dtype), bound, now)
    if keep:
        _write_cache(path, key, CacheEntry(peak.flops_per_s, peak.measured_at))
    return peak


def cache_key(name: str, dtype: torch.dtype) -> str:
    """The cache key of a measured peak: device name, torch version (a new version may bring new
    kernels), dtype and this process's thread count."""
    return f"{name}|torch={torch.__version__}|{dtype}|threads={torch.get_num_threads()}"


def peak_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    """:func:`device_peak`'s FLOP/s alone."""
    return device_peak(device, dtype).flops_per_s


def is_fresh(entry: CacheEntry, now: datetime) -> bool:
    """Whether a cached peak is younger than :data:`CACHE_MAX_AGE_DAYS` (one of unknown age is not)."""
    if entry.measured_at is None:
        return False
    return now - datetime.fromisoformat(entry.measured_at) < timedelta(days=CACHE_MAX_AGE_DAYS)


def settle(previous: CacheEntry | None, m: Measurement, bound: FmaBound | None, now: datetime) -> tuple[Peak, bool]:
    """The peak to use after measuring ``m``, and whether to cache it.

    A figure above the FMA bound at the maximum clock is capped to it (the hardware cannot go
    faster; the timer was wrong). A doubtful figure (:func:`doubt`) is never cached, and one
    below :data:`FAR_BELOW` × an earlier cached figure does not replace it: that earlier figure
    is used (source ``"cached"``). Otherwise the measured figure is used and cached.
    """
    stamp, figure, note = now.isoformat(timespec="seconds"), m.flops_per_s, ""
    if bound is not None and bound.flops_per_s is not None and bound.at_max_clock and figure > bound.flops_per_s:
        figure, note = bound.flops_per_s, f"capped: measured {m.flops_per_s / 1e9:.1f} GFLOP/s is above the bound"
    reason = doubt(Measurement(figure, m.undisturbed, m.tries), bound)
    if not reason:
        return Peak(figure, "measured", stamp, bound, note), True
    if previous is not None and figure < FAR_BELOW * previous.flops_per_s:
        kept = f"kept: a new measurement, {figure / 1e9:.1f} GFLOP/s, {reason}"
        return Peak(previous.flops_per_s, "cached", previous.measured_at, bound, kept), False
    return Peak(figure, "measured", stamp, bound, f"not cached: {reason}"), False


def doubt(m: Measurement, bound: FmaBound | None) -> str:
    """Why ``m`` is not a trustworthy peak (empty if it is): no try ran undisturbed (the cores
    were shared the whole time), or it is below :data:`IMPLAUSIBLY_LOW` × the FMA bound."""
    if not m.undisturbed:
        return f"none of {m.tries} tries had its cores to itself (a loaded machine)"
    if bound is not None and bound.flops_per_s is not None and m.flops_per_s < IMPLAUSIBLY_LOW * bound.flops_per_s:
        return f"below {IMPLAUSIBLY_LOW:.0%} of the FMA bound (a loaded machine or a slow kernel)"
    return ""


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


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (sched_getaffinity(2)), else ``os.cpu_count()``."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """``/proc/cpuinfo`` (proc(5)) as one ``{field: value}`` per logical processor (blank-line separated)."""
    cpus = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        cpus.append({k.strip(): v.strip() for k, v in fields.items()})
    return [cpu for cpu in cpus if cpu]


def fp32_flops_per_cycle(cpu: dict[str, str]) -> tuple[int | None, str]:
    """fp32 FLOP per cycle of one core (FMA units × fp32 lanes × 2), from one ``parse_cpuinfo`` entry.

    From the instruction-set flags, the vendor and the family, per the Intel 64 and IA-32
    Architectures Optimization Reference Manual and AMD's Software Optimization Guides for
    families 17h, 19h and 1Ah. Each figure is the most a part with those flags can issue, so an
    upper bound (Intel AVX-512 parts with one FMA unit reach half).

    Returns:
        (FLOP/cycle, the units assumed), or (None, why it cannot be derived).
    """
    flags = set(cpu.get("flags", "").split())
    amd = cpu.get("vendor_id") == "AuthenticAMD"
    family, model = int(cpu.get("cpu family", "0")), int(cpu.get("model", "0"))
    if "avx512f" in flags:
        if amd and family < 0x1A:
            return 32, "AVX-512 on 2×256-bit FMA, AMD Zen 4"
        return 64, "2×512-bit FMA, AVX-512"
    if {"avx2", "fma"} <= flags:
        if amd and family == 0x17 and model < 0x30:
            return 16, "2×128-bit FMA, AMD Zen/Zen+"
        return 32, "2×256-bit FMA, AVX2"
    if "avx" in flags:
        return 16, "256-bit mul + add, AVX without FMA"
    if "sse2" in flags:
        return 8, "128-bit mul + add, SSE2"
    return None, "no x86 vector flags in /proc/cpuinfo (another architecture): FLOP/cycle not tabulated"


def cpu_fma_bound(
    dtype: torch.dtype,
    threads: int,
    cpuinfo: Path = Path("/proc/cpuinfo"),
    sysfs: Path = Path("/sys/devices/system/cpu"),
    allowed: set[int] | None = None,
) -> FmaBound:
    """Theoretical peak of ``threads`` threads: cores × clock × :func:`fp32_flops_per_cycle`.

    Cores: ``min(threads, physical cores among the CPUs this process may run on)`` (``allowed``,
    default its affinity; sched_setaffinity(2)), SMT siblings counted once as they share FMA
    units. Clock: the highest ``cpufreq/cpuinfo_max_freq`` (kHz) of those CPUs, else the highest
    ``cpu MHz`` of ``cpuinfo`` (a virtual machine's: a boost may exceed it). Derived for float32
    only: bf16 and fp16 speed depends on which kernels (AMX, AVX512-BF16) torch uses.
    """
    if dtype != torch.float32:
        return FmaBound(None, f"derived for torch.float32 only, not {dtype}: it depends on the kernels torch picks")
    try:
        cpus = parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        return FmaBound(None, f"{cpuinfo} is not readable (not Linux)")
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    mine = [cpu for cpu in cpus if int(cpu.get("processor", "-1")) in allowed] or cpus
    if not mine:
        return FmaBound(None, f"no processor listed in {cpuinfo}")
    per_cycle, units = fp32_flops_per_cycle(mine[0])
    ghz, at_max, clock_source = _clock_ghz(mine, sysfs)
    if per_cycle is None or ghz is None:
        return FmaBound(None, units if per_cycle is None else clock_source)
    cores = min(threads, len({(c.get("physical id"), c.get("core id", c.get("processor"))) for c in mine}))
    basis = f"{cores} core(s) × {ghz:.2f} GHz ({clock_source}) × {per_cycle} FLOP/cycle ({units})"
    return FmaBound(cores * ghz * 1e9 * per_cycle, basis, at_max)


def _clock_ghz(cpus: list[dict[str, str]], sysfs: Path) -> tuple[float | None, bool, str]:
    """(GHz, whether it is the maximum clock, its source) of ``cpus``; kernel cpufreq docs for sysfs."""
    khz = []
    for cpu in cpus:
        with contextlib.suppress(OSError, ValueError):
            khz.append(int((sysfs / f"cpu{cpu.get('processor')}" / "cpufreq" / "cpuinfo_max_freq").read_text()))
    if khz:
        return max(khz) / 1e6, True, "cpufreq maximum"
    mhz = [float(cpu["cpu MHz"]) for cpu in cpus if "cpu MHz" in cpu]
    if mhz:
        return max(mhz) / 1e3, False, "reported clock, a boost may exceed it"
    return None, False, "no clock in cpufreq or /proc/cpuinfo"


def cache_path() -> Path:
    """The measured-peak cache: ``$LOOMTRAIN_CACHE_DIR/peak_flops.json`` or ``~/.cache/loomtrain/...``."""
    return cache_dir() / "peak_flops.json"


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, budget_s: float = BENCH_BUDGET_S) -> Measurement:
    """Best FLOP/s of ``n × n`` matmuls in ``dtype`` on ``device``, over the tries that ran undisturbed.

    ``n`` doubles from 256 until one matmul takes at least :data:`BENCH_MIN_SECONDS` (or ``n``
    reaches 8192); then tries run for ``budget_s`` seconds (at least :data:`BENCH_MIN_TRIES`).
    On a CPU a try ran undisturbed when the process's CPU time covers :data:`UNDISTURBED_SHARE`
    of wall time × threads, i.e. no thread was descheduled for another process (a shared core
    runs at a fraction of its speed; getrusage(2) CPU time excludes that). The best undisturbed
    try is kept, else the best of all, flagged. Counts ``2·n³`` FLOP per matmul. About
    ``budget_s`` + 0.1 s on a CPU.
    """
    a, b = _bench_operands(device, dtype)
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    best = {True: 0.0, False: 0.0}
    tries, start = 0, time.perf_counter()
    while tries < BENCH_MIN_TRIES or time.perf_counter() - start < budget_s:
        seconds, share = _one_try(a, b, threads)
        undisturbed = share >= UNDISTURBED_SHARE
        best[undisturbed] = max(best[undisturbed], 2 * a.shape[0] ** 3 / seconds)
        tries += 1
    return Measurement(best[True], True, tries) if best[True] else Measurement(best[False], False, tries)


def measure_matmul_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    """:func:`measure_matmul_peak`'s FLOP/s alone (undisturbed or not)."""
    return measure_matmul_peak(device, dtype).flops_per_s


def _bench_operands(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Square operands, ``n`` doubled from 256 until one matmul takes :data:`BENCH_MIN_SECONDS`."""
    n = 256
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        torch.matmul(a, b)  # the first call at a size allocates and picks kernels
        seconds, _ = _one_try(a, b, 0)
        if seconds >= BENCH_MIN_SECONDS or n >= BENCH_MAX_SIZE:
            return a, b
        n *= 2


def _one_try(a: torch.Tensor, b: torch.Tensor, threads: int) -> tuple[float, float]:
    """Seconds of one ``a @ b``, and the share of ``threads`` cores the process held meanwhile
    (1.0 when ``threads`` is 0: a GPU, or not asked)."""
    synchronize(a.device)
    wall, cpu = time.perf_counter(), time.process_time()
    torch.matmul(a, b)
    synchronize(a.device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu / (wall * threads) if threads else 1.0


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU): before reading a clock."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _read_cache(path: Path) -> dict[str, CacheEntry]:
    """The cache's entries; a bare number (written before entries carried a date) has no date."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = {}
    for key, value in raw.items() if isinstance(raw, dict) else ():
        if isinstance(value, int | float):
            entries[key] = CacheEntry(float(value), None)
        elif isinstance(value, dict) and isinstance(value.get("flops_per_s"), int | float):
            entries[key] = CacheEntry(float(value["flops_per_s"]), _aware_iso(value.get("measured_at")))
    return entries


def _aware_iso(text) -> str | None:
    """``text`` if it is an ISO 8601 time with a UTC offset, else None (its age is unknown)."""
    try:
        return text if datetime.fromisoformat(text).tzinfo is not None else None
    except (TypeError, ValueError):
        return None


def _write_cache(path: Path, key: str, entry: CacheEntry) -> None:
    """Add ``key`` to the cache; written to a temporary file and renamed so that ranks writing
    at once never leave a torn file."""
    entries = {k: v._asdict() for k, v in _read_cache(path).items()} | {key: entry._asdict()}
    write_atomic(path, json.dumps(entries, indent=1, sort_keys=True).encode())
