"""Data-parallel load balancing for devices of unequal speed (docs/load_balancing.md).

When every rank gets the same samples, a step lasts as long as the slowest rank takes (the
barrel effect). Here each data-parallel rank ``r`` measures ``t_r``, its compute seconds per
sample (forward and backward wall time, minus the time it sat blocked in collectives inside
them, over the samples it ran), smoothed by an exponential moving average. Every
``balance.interval`` steps the ranks all-gather these figures and each computes the same
decision from them: the split ``n`` of the global batch ``B`` minimising the predicted step
time ``max_r n_r·t_r`` under ``Σ n_r = B`` and ``lo <= n_r <= hi`` (at least one sample per
micro-batch; at most the memory limit). It is taken only when it is predicted at least
``balance.threshold`` faster than the current split (hysteresis, so noise does not move
samples back and forth).

The split changes which samples a rank sees, never which samples the step sees, and the
gradient average is weighted by samples (``GradientSync.set_rank_weight``), so the update
is a uniform split's up to the order of float summation.

The integer split is built greedily: starting from ``lo`` everywhere, each remaining sample
goes to the rank whose finishing time grows least. For identical jobs on machines of
different speeds this earliest-completion-time rule is optimal (Dessouky, Lageweg, Lenstra
and van de Velde, "Scheduling identical jobs on uniform parallel machines", Statistica
Neerlandica 44(3), 1990); the bounds keep it optimal because the rule never needs to take a
sample back.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from loomtrain.distributed.pipeline import stage_balance
from loomtrain.distributed.pipeline.executor import StepRecord
from loomtrain.distributed.pipeline.split import partition_layers
from loomtrain.hardware import synchronize


@dataclass(frozen=True)
class RankMeasure:
    """One data-parallel rank's smoothed measurements.

    Attributes:
        seconds_per_sample: compute seconds per sample (forward + backward, waits excluded).
        wait_s: seconds per step spent in the gradient synchronisation after compute.
        headroom_bytes: memory still free to this rank (device memory, or on CPU the memory
            limit of its cgroup or the machine's available memory, minus nothing already counted).
    """

    seconds_per_sample: float
    wait_s: float
    headroom_bytes: int


def memory_headroom_bytes(device: torch.device) -> int:
    """Bytes this rank could still allocate: free device memory on CUDA; on CPU the cgroup
    memory limit minus this process group's usage when one is set, else ``MemAvailable``
    (``/proc/meminfo``)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    limit, usage = _cgroup_memory()
    if limit is not None and usage is not None:
        return max(limit - usage, 0)
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def _cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, usage) in bytes of this process's memory cgroup (v2 or v1), or Nones."""
    files = (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    for limit_file, usage_file in files:
        for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/memory"):
            limit_path, usage_path = os.path.join(root, limit_file), os.path.join(root, usage_file)
            if os.path.isfile(limit_path) and os.path.isfile(usage_path):
                raw = open(limit_path).read().strip()
                # An unlimited v1 group reports a huge page-rounded number rather than "max".
                if raw == "max" or int(raw) >= 2**60:
                    return None, None
                return int(raw), int(open(usage_path).read().strip())
    return None, None


def moving_average(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average: ``new`` weighted ``weight``, the history ``1 - weight``
    (``old`` None: no history yet, ``new`` itself)."""
    return new if old is None else (1 - weight) * old + weight * new


class SpeedMonitor:
    """This rank's compute speed, gradient-sync wait and memory headroom, smoothed, and their
    exchange with the other ranks.

    Args:
        smoothing: weight of the newest step in the exponential moving average (1: no memory).
        device: where the exchanged tensor lives (CUDA under NCCL).
    """

    def __init__(self, smoothing: float, device: torch.device):
        self.smoothing, self.device = smoothing, device
        self.seconds_per_sample: float | None = None
        self.wait_s = 0.0

    @contextlib.contextmanager
    def compute(self, samples: int, blocked_s) -> Iterator[None]:
        """Time the forward and backward of ``samples`` samples; ``blocked_s()`` returns the
        running total of seconds spent blocked in collectives (its growth inside is taken out)."""
        synchronize(self.device)
        start, blocked = time.perf_counter(), blocked_s()
        yield
        synchronize(self.device)
        seconds = time.perf_counter() - start - (blocked_s() - blocked)
        self._smooth("seconds_per_sample", seconds / samples)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time the gradient synchronisation after compute (waiting for slower ranks included)."""
        start = time.perf_counter()
        yield
        self._smooth("wait_s", time.perf_counter() - start)

    def _smooth(self, name: str, value: float) -> None:
        setattr(self, name, moving_average(getattr(self, name), value, self.smoothing))

    def gather(self, dp_rank: int, dp: int) -> list[RankMeasure]:
        """Every dp rank's measures (a collective over all ranks). Ranks that share a dp rank
        (its tensor, sequence or pipeline peers) count as its slowest member.

        Raises:
            RuntimeError: called before any step was measured.
        """
        if self.seconds_per_sample is None:
            raise RuntimeError("no step measured yet: record a step before gathering speeds")
        mine = torch.tensor([[dp_rank, self.seconds_per_sample, self.wait_s, memory_headroom_bytes(self.device)]],
                            dtype=torch.float64, device=self.device)  # fmt: skip
        every = torch.empty(dist.get_world_size(), 4, dtype=torch.float64, device=self.device)
        dist.all_gather_single(every, mine)
        worst: dict[int, RankMeasure] = {}
        for rank, seconds, wait, headroom in every.cpu().tolist():
            have = worst.get(int(rank))
            if have is None or seconds > have.seconds_per_sample:
                worst[int(rank)] = RankMeasure(seconds, wait, int(headroom))
        return [worst[r] for r in range(dp)]


def balanced_split(total: int, seconds_per_sample: list[float], low: int, high: int) -> list[int]:
    """Samples per rank minimising ``max_r n_r·t_r`` with ``Σ n_r = total``, ``low <= n_r <= high``
    (see the module docstring for the rule and its optimality). Ties go to the lower rank.

    Raises:
        ValueError: the bounds cannot hold ``total`` samples, or a non-positive time.
    """
    n = len(seconds_per_sample)
    if not low * n <= total <= high * n:
        raise ValueError(f"{total} samples cannot be split over {n} ranks with {low}..{high} each")
    if min(seconds_per_sample) <= 0:
        raise ValueError(f"seconds per sample must be positive, got {seconds_per_sample}")
    split = [low] * n
    heap = [((low + 1) * t, r) for r, t in enumerate(seconds_per_sample)]
    heapq.heapify(heap)
    for _ in range(total - low * n):
        _, r = heapq.heappop(heap)
        split[r] += 1
        if split[r] < high:
            heapq.heappush(heap, ((split[r] + 1) * seconds_per_sample[r], r))
    return split


def predicted_step_s(split: list[int], seconds_per_sample: list[float]) -> float:
    """The compute time of a step under ``split``: its slowest rank's, ``max_r n_r·t_r`` (seconds)."""
    return max(n * t for n, t in zip(split, seconds_per_sample, strict=True))


@dataclass
class Rebalance:
    """A balancer decision, as written to ``events.jsonl``."""

    step: int
    before: list[int]
    after: list[int]
    predicted_before_s: float
    predicted_after_s: float
    seconds_per_sample: list[float]


class DataBalancer:
    """Owns the split of each step's global batch over the dp ranks and decides when it changes.

    Args:
        global_batch: samples per step (all ranks).
        dp: data-parallel ranks.
        micro_batches: micro-batches per rank per step (each needs at least one sample).
        max_micro_batch_size: memory limit per micro-batch (0: none).
        threshold: relative predicted gain below which the split stays.
        fixed: a hand-set split (never changed), or empty to follow measured speed.
    """

    def __init__(self, global_batch: int, dp: int, micro_batches: int, max_micro_batch_size: int, threshold: float,
                 fixed: list[int] | None = None):  # fmt: skip
        self.global_batch, self.dp, self.threshold = global_batch, dp, threshold
        self.low = micro_batches
        self.high = max_micro_batch_size * micro_batches if max_micro_batch_size else global_batch
        self.fixed = bool(fixed)
        base, extra = divmod(global_batch, dp)
        self.split = list(fixed) if fixed else [base + (r < extra) for r in range(dp)]
        self.rebalances = 0

    def decide(self, step: int, measures: list[RankMeasure]) -> Rebalance | None:
        """The new split if measured speeds predict it at least ``threshold`` faster, else ``None``."""
        if self.fixed:
            return None
        seconds = [m.seconds_per_sample for m in measures]
        proposal = balanced_split(self.global_batch, seconds, self.low, self.high)
        now, then = predicted_step_s(self.split, seconds), predicted_step_s(proposal, seconds)
        if then > now * (1 - self.threshold):
            return None
        decision = Rebalance(step, self.split, proposal, now, then, seconds)
        self.split = proposal
        self.rebalances += 1
        return decision

    def state_dict(self) -> dict[str, Any]:
        """The current split and the number of rebalances (JSON-able, the same on every rank)."""
        return {"split": list(self.split), "rebalances": self.rebalances}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the split of a run with the same dp degree and global batch; another
        layout's split does not fit and is dropped (the balancer starts even again)."""
        split = state.get("split", [])
        if not self.fixed and len(split) == self.dp and sum(split) == self.global_batch:
            self.split = [int(n) for n in split]
            self.rebalances = int(state.get("rebalances", 0))


def rebalance_event(decision: Rebalance | StageRebalance) -> dict[str, Any]:
    """The ``events.jsonl`` fields of a decision."""
    return asdict(decision)


@dataclass
class StageRebalance:
    """A pipeline balancer decision, as written to ``events.jsonl``."""

    step: int
    before: list[int]
    after: list[int]
    predicted_before_s: float
    predicted_after_s: float
    rank_speeds: list[float]


class PipelineBalancer:
    """Owns the pipeline split (the layers of each of the ``pp·v`` stages) and decides when
    layers move.

    Transformer blocks are identical, so each counts one cost unit; a pipeline rank's speed
    is the blocks it ran per second of its measured forward and backward time (the slowest
    data-parallel replica's, as that pipeline sets the step's pace). The first and last ranks
    also run the embedding and the head: their time counts against their blocks, so they are
    given fewer blocks accordingly. See ``pipeline/stage_balance.py`` for the split and the
    predicted step time.

    Args:
        n_layers, pp, v: blocks, pipeline ranks, stages per rank.
        n_micro: micro-batches per step.
        boundaries: the current split's first layer of every stage but the first (empty: by count).
        threshold: relative predicted step-time gain below which layers stay.
        smoothing: weight of the newest step in the moving average of stage times.
    """

    def __init__(self, n_layers: int, pp: int, v: int, n_micro: int, boundaries: list[int], threshold: float,
                 smoothing: float):  # fmt: skip
        self.pp, self.v, self.n_micro, self.threshold, self.smoothing = pp, v, n_micro, threshold, smoothing
        self.costs = [1.0] * n_layers
        self.stages = partition_layers(n_layers, pp * v, boundaries)
        self.left: list[list[int]] | None = None
        self.seconds: list[float] | None = None
        self.rebalances = 0
        self.rebuilt = False

    @property
    def boundaries(self) -> list[int]:
        """The first layer of every stage but the first (``parallel.stage_boundaries``)."""
        return [stage[0] for stage in self.stages[1:]]

    def record(self, record: StepRecord) -> None:
        """Fold one step's measured stage times (from the pipeline executor) into the average.

        The first step after a move is dropped: the rebuilt stages allocate and initialise
        lazily in it, which would charge one rank for a warm-up rather than its speed."""
        if self.rebuilt:
            self.rebuilt = False
            return
        now = stage_balance.stage_seconds(record, len(self.stages))
        old = self.seconds or [None] * len(now)
        self.seconds = [moving_average(a, b, self.smoothing) for a, b in zip(old, now, strict=True)]

    def gather(self, device: torch.device) -> list[float]:
        """Per stage, the largest averaged time over all data-parallel replicas (a collective
        over all ranks).

        Raises:
            RuntimeError: called before any step was recorded.
        """
        if self.seconds is None:
            raise RuntimeError("no pipeline step recorded yet: record a step before gathering stage times")
        mine = torch.tensor([self.seconds], dtype=torch.float64, device=device)
        every = torch.empty(dist.get_world_size(), len(self.seconds), dtype=torch.float64, device=device)
        dist.all_gather_single(every, mine)
        return every.max(dim=0).values.cpu().tolist()

    def decide(self, step: int, stage_secs: list[float]) -> StageRebalance | None:
        """The new split if the measured speeds predict it at least ``threshold`` faster."""
        speeds = stage_balance.rank_speeds(stage_secs, self.stages, self.costs, self.pp)
        proposal = stage_balance.balanced_stages(self.costs, speeds, self.pp, self.v)
        now = stage_balance.predicted_step_s(self.stages, self.costs, speeds, self.n_micro, self.pp, self.v)
        then = stage_balance.predicted_step_s(proposal, self.costs, speeds, self.n_micro, self.pp, self.v)
        # Never straight back to the split just left: under a measurement that depends on the
        # split (an idle rank runs faster), two splits could otherwise swap at every decision.
        if proposal in (self.stages, self.left) or not stage_balance.should_repartition(now, then, self.threshold):
            return None
        decision = StageRebalance(step, self.boundaries, [s[0] for s in proposal[1:]], now, then, speeds)
        self.left, self.stages, self.seconds = self.stages, proposal, None  # old times no longer apply
        self.rebalances, self.rebuilt = self.rebalances + 1, True
        return decision

    def state_dict(self) -> dict[str, Any]:
        """The split's boundaries and the number of rebalances (JSON-able)."""
        return {"boundaries": self.boundaries, "rebalances": self.rebalances}
