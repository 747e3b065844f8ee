"""Profiling: ``torch.profiler`` traces and CUDA memory snapshots of chosen steps
(``profile.steps``), and the fraction of gradient communication hidden behind compute.

Traces are Chrome trace JSON (``export_chrome_trace``), one fixed file per rank, which Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open as they are; PyTorch's profiler recipe
recommends those viewers, TensorBoard's profiler plugin being deprecated. Memory snapshots
are ``torch.cuda.memory._dump_snapshot`` pickles for pytorch.org/memory_viz (PyTorch's
"Understanding CUDA Memory Usage" page). See ``docs/profiling.md``.

The overlap figure (:class:`CommOverlap`) follows Llama 3's point (Llama Team, "The Llama 3
Herd of Models", 2024, §3.3.2): gradient reduction should run while backward still computes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerAction, ProfilerActivity, profile

if TYPE_CHECKING:
    from loomtrain.config import Config
    from loomtrain.metrics import EventLog

log = logging.getLogger(__name__)

# Allocation events the CUDA memory history keeps (its newest): bounded, so a long traced range
# cannot grow host memory without limit.
MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    """Records ``profile.steps`` N..M of this rank; the trainer calls :meth:`step` before each
    training step and :meth:`close` after the last.

    Writes ``<run>/profile/rank_XXXXX.json`` (CPU activity always, CUDA kernels on CUDA, with
    input shapes and memory events) and, on CUDA with ``profile.memory_snapshot``,
    ``<run>/profile/memory_rank_XXXXX.pickle``; rank 0 logs a ``profile`` event. The step
    before N, when this run executes it, is a profiler warm-up step (not in the trace: the
    profiler's set-up skews the first step it records, ``torch.profiler.schedule``'s docs).
    Each traced step is a ``ProfilerStep#k`` range, ``k`` the training step (1-based, as in
    ``metrics.jsonl``), spanning the whole iteration. A resumed run traces the steps of N..M it
    still runs.

    Args:
        cfg: the run's config (``profile``, ``run_dir``).
        device: this rank's device.
        start_step: the steps already done (a resumed run's checkpoint step, else 0).
        events: the run's event log.
    """

    def __init__(self, cfg: Config, device: torch.device, start_step: int, events: EventLog):
        self.range, self.events, self.device = cfg.profile.step_range, events, device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.folder = cfg.run_dir / "profile"
        self.snapshot = cfg.profile.memory_snapshot and device.type == "cuda"
        self._prof: profile | None = None
        if self.range is None or self.range[1] <= start_step:
            return
        if cfg.profile.memory_snapshot and not self.snapshot and self.rank == 0:
            log.info("profile: no memory snapshot on a %s device (CUDA only); writing the trace alone", device.type)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._start(start_step)

    @property
    def trace_path(self) -> Path:
        """This rank's Chrome trace, ``<run>/profile/rank_XXXXX.json``."""
        return self.folder / f"rank_{self.rank:05d}.json"

    @property
    def snapshot_path(self) -> Path:
        """This rank's CUDA memory snapshot, ``<run>/profile/memory_rank_XXXXX.pickle``."""
        return self.folder / f"memory_rank_{self.rank:05d}.pickle"

    def _start(self, start_step: int) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        first, last = self.range
        self._first = max(first, start_step + 1)
        warm_up = first - 1 if first - 1 > start_step else None

        def action(step: int) -> ProfilerAction:
            if step == warm_up:
                return ProfilerAction.WARMUP
            if self._first <= step < last:
                return ProfilerAction.RECORD
            return ProfilerAction.RECORD_AND_SAVE if step == last else ProfilerAction.NONE

        self._prof = profile(activities=activities, schedule=action, on_trace_ready=self._write, record_shapes=True,
                             profile_memory=True)  # fmt: skip
        # step() runs before each training step and moves step_num onto it: ProfilerStep#k is step k.
        self._prof.step_num = start_step
        self._prof.start()

    def step(self, step: int) -> None:
        """Call just before training step ``step`` (1-based) runs."""
        if self._prof is None:
            return
        if self.snapshot and step == self._first:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        if step > self.range[1]:
            self.close()
            return
        self._prof.step()

    def close(self) -> None:
        """Stop recording, writing what the traced steps recorded (idempotent)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()

    def _write(self, prof: profile) -> None:
        prof.export_chrome_trace(str(self.trace_path))
        snapshot = None
        if self.snapshot:
            torch.cuda.memory._dump_snapshot(str(self.snapshot_path))
            torch.cuda.memory._record_memory_history(enabled=None)
            snapshot = str(self.snapshot_path)
        # step_num is the last traced step: M, or an earlier one where a preempted run stopped.
        self.events("profile", steps=f"{self._first}:{prof.step_num}", trace=str(self.trace_path),
                    memory_snapshot=snapshot)  # fmt: skip


@dataclass(frozen=True)
class StepComm:
    """One step's gradient communication on one rank, in seconds of the host clock (see
    :class:`CommOverlap` for the definitions)."""

    hidden_s: float
    exposed_s: float

    @property
    def comm_s(self) -> float:
        """All gradient communication time of the step: hidden plus exposed (seconds)."""
        return self.hidden_s + self.exposed_s


def completion_future(handle: Any) -> torch.futures.Future | None:
    """The future that completes when ``handle``'s collective does, or ``None`` where the handle
    cannot tell: a ``Pending`` (``data_parallel.py``) is looked through to its collective; a
    ``Work`` without a future (gloo's reduce-scatter) or a ``Pending`` without a collective (the
    hierarchical hook) gives ``None``."""
    work = getattr(handle, "work", handle)
    if isinstance(work, torch.futures.Future):
        return work
    if isinstance(work, dist.Work):
        try:
            return work.get_future()
        except RuntimeError:
            return None
    return None


class CommOverlap:
    """Splits one rank's gradient communication into the part hidden behind backward and the
    exposed part, step by step, from the host clock: it adds no device synchronisation and no
    collective to the step.

    Per step, with C the end of compute (when ``finish_gradient_sync`` begins):

    - a collective is *in flight* from the return of its launch call until the first poll (every
      gradient hook polls) that finds its future completed; one whose handle cannot report
      completion (:func:`completion_future` is ``None``) counts as in flight until C;
    - ``exposed_s``: time inside launch calls made before C (a launch that blocks, as gloo's
      reduce-scatter does while it copies its input, holds backward up) plus the time from C until
      ``finish_gradient_sync`` returns (waiting for the reductions, decoding, late launches);
    - ``hidden_s``: time before C during which a collective was in flight and no launch call ran;
    - ``comm_s = hidden_s + exposed_s``; the hidden fraction is ``1 - exposed_s / comm_s``.

    Host clocks see gloo's collectives complete; NCCL's run on the device asynchronously to the
    host, so on CUDA the timer is off (``enabled`` False) and :meth:`pop` returns ``None``.
    The synchronizers call :meth:`launched` after starting each reduction, :meth:`poll` in each
    gradient hook, :meth:`compute_ended` and :meth:`synced` around ``finish_gradient_sync``.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._in_flight: list[tuple[float, torch.futures.Future | None]] = []
        self._spans: list[tuple[float, float]] = []
        self._blocked: list[tuple[float, float]] = []
        self._compute_end: float | None = None
        self._last: StepComm | None = None

    def launched(self, handle: Any, start: float) -> None:
        """A reduction was started by a call that began at ``start`` (``time.perf_counter``
        seconds) and returned ``handle``. One launched after C is all exposed: not tracked."""
        if not self.enabled or self._compute_end is not None:
            return
        now = time.perf_counter()
        self._blocked.append((start, now))
        self._in_flight.append((now, completion_future(handle)))

    def poll(self) -> None:
        """End the in-flight span of every collective whose future has completed."""
        if not self._in_flight:
            return
        now, still = time.perf_counter(), []
        for start, future in self._in_flight:
            if future is not None and future.done():
                self._spans.append((start, now))
            else:
                still.append((start, future))
        self._in_flight = still

    def compute_ended(self) -> None:
        """Backward is over (C): what is still in flight from here on is exposed."""
        if not self.enabled:
            return
        self.poll()
        self._compute_end = time.perf_counter()
        self._spans += [(start, self._compute_end) for start, _ in self._in_flight]
        self._in_flight = []

    def synced(self) -> None:
        """The gradients are synchronized: close the step's record."""
        if self._compute_end is None:
            return
        blocked, spans = _merged(self._blocked), _merged(self._spans)
        exposed = time.perf_counter() - self._compute_end + _length(blocked)
        self._last = StepComm(hidden_s=_length(spans) - _overlap(spans, blocked), exposed_s=exposed)
        self._spans, self._blocked, self._compute_end = [], [], None

    def pop(self) -> StepComm | None:
        """The last synchronized step's record, once (``None`` if none since the last call)."""
        last, self._last = self._last, None
        return last


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` as sorted disjoint spans covering the same time."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the time covered by both ``a`` and ``b`` (each sorted and disjoint)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_figures(steps: list[StepComm], device: torch.device) -> dict[str, float]:
    """``comm_s`` and ``comm_exposed_s`` (seconds per step) and ``comm_hidden_fraction``
    (``1 - Σ exposed / Σ comm``) over ``steps`` of every rank: one all-reduce of three numbers,
    so every rank calls it with its own steps. Empty if no rank timed any communication."""
    sums = [sum(s.hidden_s for s in steps), sum(s.exposed_s for s in steps), float(len(steps))]
    totals = torch.tensor(sums, dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    hidden, exposed, count = totals.tolist()
    if count == 0 or hidden + exposed <= 0:
        return {}
    return {
        "comm_s": (hidden + exposed) / count,
        "comm_exposed_s": exposed / count,
        "comm_hidden_fraction": hidden / (hidden + exposed),
    }
