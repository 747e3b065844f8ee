"""Splitting a model's layers into pipeline stages (the model-aware pruning to one rank's
stages is ``models/parallelize.py``).

A stage is a run of consecutive layers; the first stage also holds the embedding, the last
the final norm and output head. With ``v`` virtual stages per rank (interleaved 1F1B,
Narayanan et al. 2021 §2.2.2) the model is cut into ``pp·v`` stages and stage ``s`` goes to
pipeline rank ``s % pp``, so every rank holds ``v`` separate runs of layers.

The split is by layer count, by measured per-layer time (a contiguous partition minimising
the slowest stage, the quantity a pipeline's step time follows), or by explicit boundaries.
On a heterogeneous cluster each stage may also carry the relative speed of the device that
runs it, and the slowest stage is then the one with the largest cost / speed (see
``stage_balance.py`` for where the speeds come from).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def partition_layers(
    n_layers: int,
    n_stages: int,
    boundaries: Sequence[int] = (),
    costs: Sequence[float] | None = None,
    stage_speeds: Sequence[float] | None = None,
) -> list[list[int]]:
    """Layer indices of each stage: ``n_stages`` runs of consecutive layers covering ``0..n_layers-1``.

    ``boundaries``: the first layer of every stage after the first (``n_stages - 1`` increasing
    indices); used as given when not empty. Else with ``costs`` (one per layer, any unit, e.g.
    seconds) the runs minimise the largest stage cost (exact, by dynamic programming over cut
    points). Else by count: ``n_layers // n_stages`` each, the first ``n_layers % n_stages``
    stages one more.

    ``stage_speeds``: one relative speed per stage (of the device of the pp rank running it;
    stage ``s`` runs on rank ``s % pp``), in cost units per second. With it the runs minimise the
    largest ``stage cost / stage speed``, i.e. the slowest stage's time; without ``costs`` every
    layer costs 1. Ignored when ``boundaries`` are given. Without it the result is unchanged.

    Raises:
        ValueError: fewer layers than stages; boundaries that are not ``n_stages - 1``
            increasing indices in ``1..n_layers-1``; ``stage_speeds`` not ``n_stages`` finite
            numbers above 0.
    """
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} pipeline stages; each needs a layer")
    if stage_speeds is not None:
        _check_speeds(stage_speeds, n_stages)
    if boundaries:
        cuts = list(boundaries)
        if len(cuts) != n_stages - 1 or cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] >= n_layers:
            raise ValueError(
                f"stage boundaries {cuts} must be {n_stages - 1} increasing layer indices in 1..{n_layers - 1}"
            )
    elif costs is not None or stage_speeds is not None:
        layer_costs = [1.0] * n_layers if costs is None else list(costs)
        cuts = _balanced_cuts(layer_costs, n_stages, None if stage_speeds is None else list(stage_speeds))
    else:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (i < extra) for i in range(n_stages)]
        cuts = [sum(sizes[: i + 1]) for i in range(n_stages - 1)]
    edges = [0, *cuts, n_layers]
    return [list(range(edges[i], edges[i + 1])) for i in range(n_stages)]


def _check_speeds(stage_speeds: Sequence[float], n_stages: int) -> None:
    """Raise ValueError unless ``stage_speeds`` is ``n_stages`` finite numbers above 0."""
    speeds = list(stage_speeds)
    if len(speeds) != n_stages:
        raise ValueError(f"stage_speeds has {len(speeds)} entries; give one per stage ({n_stages})")
    bad = [(s, x) for s, x in enumerate(speeds) if not 0 < x < math.inf]
    if bad:
        raise ValueError(f"stage_speeds must be finite and above 0; stage {bad[0][0]} has {bad[0][1]}")


def _balanced_cuts(costs: list[float], n_stages: int, speeds: list[float] | None = None) -> list[int]:
    """Cut points of the contiguous partition of ``costs`` into ``n_stages`` non-empty runs
    whose largest ``sum / speed`` is smallest, the ``k``-th run divided by ``speeds[k]`` (all 1
    without ``speeds``; ties: the first found, scanning cut points left to right).

    Exact dynamic programming over cut points, ``O(n_stages · n²)``: the linear-partition
    recurrence (Skiena, *The Algorithm Design Manual*, 2nd ed., §8.5 "The Partition Problem"),
    with each run's sum divided by its own speed.
    """
    n = len(costs)
    # x / 1.0 == x exactly, so without speeds every comparison, and the result, is as before.
    speeds = [1.0] * n_stages if speeds is None else speeds
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest possible slowest-run time splitting layers [0, i) into k runs.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], (prefix[i] - prefix[j]) / speeds[k - 1])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    cuts, i = [], n
    for k in range(n_stages, 1, -1):
        i = cut[k][i]
        cuts.append(i)
    return cuts[::-1]
