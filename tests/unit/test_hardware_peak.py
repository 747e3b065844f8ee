"""The peak MFU is computed against: the CPU's theoretical FMA bound from /proc/cpuinfo, a
measurement kept only when it can be trusted, a cache that expires, and a report of which
figure was used; and the launcher's warning for more processes than the cores can run.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta

import pytest
import torch

from loomtrain import hardware
from loomtrain.hardware import CacheEntry, FmaBound, Measurement, Peak, settle
from loomtrain.preflight import oversubscription_warning, warn_if_oversubscribed

CPU = torch.device("cpu")
NOW = datetime(2025, 6, 1, tzinfo=UTC)
ZEN3 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "1", "flags": "sse2 avx fma avx2"}
# Two logical CPUs that are SMT siblings of one core, a Skylake-SP with AVX-512.
SKYLAKE_SP_SMT = "\n\n".join(
    f"processor\t: {i}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\n"
    f"cpu MHz\t\t: 2100.000\nphysical id\t: 0\ncore id\t\t: 0\nflags\t\t: sse2 avx fma avx2 avx512f\n"
    for i in range(2)
)


def test_fma_flops_per_cycle_follow_the_vector_units():
    """Catches: a bound that ignores the vector width (AVX-512 counted as AVX2), counts Zen 4's
    two 256-bit halves as two 512-bit units, gives Zen 1's 128-bit units the Zen 2 figure, or
    invents a figure for an architecture it has no table for."""
    per_cycle = hardware.fp32_flops_per_cycle
    assert per_cycle(ZEN3)[0] == 32
    assert per_cycle({**ZEN3, "cpu family": "23", "model": "1"})[0] == 16  # Zen 1
    assert per_cycle({**ZEN3, "flags": "sse2 avx fma avx2 avx512f"})[0] == 32  # Zen 4
    assert per_cycle({**ZEN3, "cpu family": "26", "flags": "avx2 fma avx512f"})[0] == 64  # Zen 5
    assert per_cycle({"vendor_id": "GenuineIntel", "flags": "sse2 avx fma avx2 avx512f"})[0] == 64
    assert per_cycle({"vendor_id": "GenuineIntel", "flags": "sse2 avx"})[0] == 16  # Sandy Bridge
    figure, why = per_cycle({"Features": "fp asimd"})  # aarch64
    assert figure is None and "not tabulated" in why


def test_fma_bound_counts_physical_cores_at_the_maximum_clock(tmp_path):
    """Catches: SMT siblings counted as two cores (they share the FMA units), a bound for more
    cores than the process has threads, the reported clock preferred to cpufreq's maximum, and a
    bound claimed for bf16 or without /proc/cpuinfo."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(SKYLAKE_SP_SMT)
    for i in range(2):
        (tmp_path / f"cpu{i}" / "cpufreq").mkdir(parents=True)
        (tmp_path / f"cpu{i}" / "cpufreq" / "cpuinfo_max_freq").write_text("3700000\n")
    bound = hardware.cpu_fma_bound(torch.float32, 8, cpuinfo, tmp_path, allowed={0, 1})
    assert bound.flops_per_s == pytest.approx(1 * 3.7e9 * 64) and bound.at_max_clock
    assert "cpufreq" in bound.basis
    no_freq = hardware.cpu_fma_bound(torch.float32, 8, cpuinfo, tmp_path / "none", allowed={0, 1})
    assert no_freq.flops_per_s == pytest.approx(2.1e9 * 64) and not no_freq.at_max_clock
    assert hardware.cpu_fma_bound(torch.bfloat16, 8, cpuinfo, tmp_path).flops_per_s is None
    assert "not readable" in hardware.cpu_fma_bound(torch.float32, 1, tmp_path / "missing").basis


def test_a_doubtful_measurement_never_replaces_a_better_cached_peak():
    """Catches: a peak measured while other processes held the cores (the 60 % MFU read on a
    loaded 2-core VM) cached, or replacing a higher earlier figure, and a figure far below the
    FMA bound trusted."""
    previous = CacheEntry(90e9, "2025-01-01T00:00:00+00:00")
    bound = FmaBound(80e9, "1 core(s) × 2.50 GHz (cpufreq maximum) × 32", at_max_clock=True)
    peak, keep = settle(previous, Measurement(45e9, undisturbed=False, tries=30), bound, NOW)
    assert (peak.flops_per_s, peak.source, peak.measured_at, keep) == (90e9, "cached", previous.measured_at, False)
    assert "kept" in peak.note and "tries" in peak.note
    peak, keep = settle(None, Measurement(45e9, undisturbed=False, tries=30), bound, NOW)
    assert (peak.flops_per_s, peak.source, keep) == (45e9, "measured", False) and "not cached" in peak.note
    peak, keep = settle(None, Measurement(10e9, undisturbed=True, tries=30), bound, NOW)
    assert not keep and "FMA bound" in peak.note
    peak, keep = settle(previous, Measurement(70e9, undisturbed=True, tries=30), bound, NOW)
    assert (peak.flops_per_s, peak.source, peak.measured_at, keep) == (70e9, "measured", NOW.isoformat(), True)


def test_a_measurement_above_the_bound_at_the_maximum_clock_is_capped():
    """Catches: an impossible figure (above what the cores can issue at their top clock) used as
    the peak, or the cap applied to a reported clock that a boost may exceed."""
    at_max = FmaBound(80e9, "max", at_max_clock=True)
    peak, _ = settle(None, Measurement(95e9, True, 30), at_max, NOW)
    assert peak.flops_per_s == 80e9 and "capped" in peak.note
    peak, _ = settle(None, Measurement(95e9, True, 30), at_max._replace(at_max_clock=False), NOW)
    assert peak.flops_per_s == 95e9


def test_a_fresh_cached_peak_is_used_with_its_date(tmp_path, monkeypatch):
    """Catches: the CPU peak re-measured at every start although a recent figure is cached (an
    MFU denominator that drifts between runs), or used without saying it came from the cache."""
    monkeypatch.setenv("LOOMTRAIN_CACHE_DIR", str(tmp_path))
    when = (datetime.now(UTC) - timedelta(days=1)).isoformat(timespec="seconds")
    key = hardware.cache_key(hardware.device_name(CPU), torch.float32)
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: {"flops_per_s": 1.5e11, "measured_at": when}}))
    peak = hardware.device_peak(CPU, torch.float32)
    assert (peak.flops_per_s, peak.source, peak.measured_at) == (1.5e11, "cached", when)
    assert f"cached {when[:10]}" in peak.describe()
    assert torch.__version__ in key and f"threads={torch.get_num_threads()}" in key


def test_a_stale_or_undated_cached_peak_is_measured_again(tmp_path, monkeypatch):
    """Catches: a peak cached forever (a figure from a loaded day or an old kernel used for every
    later run), an old-format entry (a bare number, no date) trusted, and a trustworthy new
    measurement not written back with its date."""
    monkeypatch.setenv("LOOMTRAIN_CACHE_DIR", str(tmp_path))
    path, key = tmp_path / "peak_flops.json", hardware.cache_key(hardware.device_name(CPU), torch.float32)
    stale = (datetime.now(UTC) - timedelta(days=hardware.CACHE_MAX_AGE_DAYS + 1)).isoformat()
    # 1 FLOP/s: below any real measurement, so the new figure is used whether or not it is doubtful.
    for old in ({"flops_per_s": 1.0, "measured_at": stale}, 1.0):
        path.write_text(json.dumps({key: old}))
        peak = hardware.device_peak(CPU, torch.float32)
        assert peak.source == "measured" and peak.flops_per_s > 1.0
        entry = json.loads(path.read_text())[key]
        if peak.note.startswith("not cached"):  # no try ran undisturbed: the stale entry stays
            assert entry == old
        else:
            assert entry == {"flops_per_s": peak.flops_per_s, "measured_at": peak.measured_at}


def test_peak_report_names_source_date_and_bound():
    """Catches: a summary or start-up line that gives the peak without saying whether it was a
    datasheet figure, measured now or read from the cache (and when it was measured)."""
    bound = FmaBound(78e9, "1 core(s) × 2.45 GHz × 32 FLOP/cycle")
    peak = Peak(85.4e9, "cached", "2025-05-30T10:00:00+00:00", bound)
    assert peak.describe().startswith("85.4 GFLOP/s (cached 2025-05-30; FMA bound 78.0 GFLOP/s: 1 core(s)")
    fields = peak.as_dict()
    assert fields["source"] == "cached" and fields["measured_at"] == peak.measured_at
    assert fields["fma_bound_flops_per_s"] == 78e9 and fields["fma_bound_basis"] == bound.basis


def test_nproc_beyond_the_cores_warns_once_in_one_line(capsys, monkeypatch):
    """Catches: ``--nproc`` far beyond the machine's cores accepted silently (every process then
    gets a sliver of a core and the run's speed figures mislead), a warning at a sensible nproc,
    or a multi-line message."""
    assert oversubscription_warning(4, 1, 2) is None
    message = oversubscription_warning(16, 1, 2)
    assert "--nproc=16" in message and "2 CPU(s)" in message and "0.12 of a core" in message
    assert "\n" not in message
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cpus = len(os.sched_getaffinity(0))
    warn_if_oversubscribed(2 * cpus)
    assert capsys.readouterr().err == ""
    warn_if_oversubscribed(2 * cpus + 1)
    assert capsys.readouterr().err.count("warning: --nproc=") == 1
