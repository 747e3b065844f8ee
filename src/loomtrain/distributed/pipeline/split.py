"""Splitting a model's layers into pipeline stages (the model-aware pruning to one rank's
stages is ``models/parallelize.py``).

A stage is a run of consecutive layers; the first stage also holds the embedding, the last
the final norm and output head. With ``v`` virtual stages per rank (interleaved 1F1B,
Narayanan et al. 2021 §2.2.2) the model is cut into ``pp·v`` stages and stage ``s`` goes to
pipeline rank ``s % pp``, so every rank holds ``v`` separate runs of layers.

The split is by layer count, by measured per-layer time (a contiguous partition minimising
the slowest stage, the quantity a pipeline's step time follows), or by explicit boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence


def partition_layers(
    n_layers: int, n_stages: int, boundaries: Sequence[int] = (), costs: Sequence[float] | None = None
) -> list[list[int]]:
    """Layer indices of each stage: ``n_stages`` runs of consecutive layers covering ``0..n_layers-1``.

    ``boundaries``: the first layer of every stage after the first (``n_stages - 1`` increasing
    indices); used as given when not empty. Else with ``costs`` (one per layer, any unit, e.g.
    seconds) the runs minimise the largest stage cost (exact, by dynamic programming over cut
    points). Else by count: ``n_layers // n_stages`` each, the first ``n_layers % n_stages``
    stages one more.

    Raises:
        ValueError: fewer layers than stages, or boundaries that are not ``n_stages - 1``
            increasing indices in ``1..n_layers-1``.
    """
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} pipeline stages; each needs a layer")
    if boundaries:
        cuts = list(boundaries)
        if len(cuts) != n_stages - 1 or cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] >= n_layers:
            raise ValueError(
                f"stage boundaries {cuts} must be {n_stages - 1} increasing layer indices in 1..{n_layers - 1}"
            )
    elif costs is not None:
        cuts = _balanced_cuts(list(costs), n_stages)
    else:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (i < extra) for i in range(n_stages)]
        cuts = [sum(sizes[: i + 1]) for i in range(n_stages - 1)]
    edges = [0, *cuts, n_layers]
    return [list(range(edges[i], edges[i + 1])) for i in range(n_stages)]


def _balanced_cuts(costs: list[float], n_stages: int) -> list[int]:
    """Cut points of the contiguous partition of ``costs`` into ``n_stages`` non-empty runs
    whose largest sum is smallest (ties: the first found, scanning cut points left to right)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest possible largest-run cost splitting layers [0, i) into k runs.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    cuts, i = [], n
    for k in range(n_stages, 1, -1):
        i = cut[k][i]
        cuts.append(i)
    return cuts[::-1]
