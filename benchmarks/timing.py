"""Step timing shared by the benchmarks that race our implementation against a torch peer.

A step lasts until its slowest rank finishes: every rank starts together (barrier) and the
ranks agree on the largest elapsed time (all-reduce MAX). Implementations are timed in
interleaved rounds whose order alternates, so drifts in machine load hit each alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def slowest_rank_seconds(step: Callable[[], object]) -> float:
    """Wall seconds of ``step()`` on the slowest rank (a collective: every rank calls it)."""
    dist.barrier()
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def interleaved_rounds(runs: dict[str, Callable[[int], object]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Per name, the step seconds of ``rounds × steps`` calls ``runs[name](i)``, ``i`` in
    ``range(steps)`` each round; even rounds run the names in the given order, odd ones reversed."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name] += [slowest_rank_seconds(lambda i=i, run=runs[name]: run(i)) for i in range(steps)]
    return times
