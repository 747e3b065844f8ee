"""Splitting a model's layers into pipeline stages, and pruning a model to one rank's stages.

A stage is a run of consecutive layers; the first stage also holds the embedding, the last
the final norm and output head. With ``v`` virtual stages per rank (interleaved 1F1B,
Narayanan et al. 2021 §2.2.2) the model is cut into ``pp·v`` stages and stage ``s`` goes to
pipeline rank ``s % pp``, so every rank holds ``v`` separate runs of layers.

The split is by layer count, by measured per-layer time (a contiguous partition minimising
the slowest stage, the quantity a pipeline's step time follows), or by explicit boundaries.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from loomtrain.distributed.pipeline.schedule import rank_stages
from loomtrain.hardware import synchronize
from loomtrain.models.llama import Transformer


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


def measure_layer_seconds(model: Transformer, tokens: torch.Tensor, repeats: int = 3) -> list[float]:
    """Forward plus backward seconds of each block of ``model`` on one micro-batch (median of
    ``repeats`` after a warm-up), for a balanced split. ``tokens``: ``LongTensor[B, S]``.

    Every rank measures; callers average over ranks so all agree on one split.
    """
    with torch.no_grad():
        h = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[: tokens.shape[1]], model.rope_sin[: tokens.shape[1]]
    seconds = []
    for layer in model.layers.values():
        x = h.detach().requires_grad_(True)
        times = []
        for _ in range(repeats + 1):
            synchronize(tokens.device)
            start = time.perf_counter()
            layer(x, cos, sin).sum().backward()
            synchronize(tokens.device)
            times.append(time.perf_counter() - start)
        seconds.append(sorted(times[1:])[len(times[1:]) // 2])
        with torch.no_grad():
            h = layer(h, cos, sin)
    model.zero_grad(set_to_none=True)
    return seconds


def prune_to_rank(model: Transformer, stage_layers: list[list[int]], pp_rank: int, pp: int) -> dict[int, list[str]]:
    """Keep, in place, only what pipeline rank ``pp_rank`` runs: its stages' layers, the
    embedding if it holds stage 0, the final norm and head if it holds the last stage.
    Parameter names do not change (``layers.7.…`` stays ``layers.7.…``), so checkpoints load
    across pipeline degrees.

    Returns:
        ``{stage: [layer keys]}`` for this rank's stages, in stage order.
    """
    n_stages = len(stage_layers)
    mine = rank_stages(pp_rank, pp, n_stages // pp)
    keep = {str(i) for s in mine for i in stage_layers[s]}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if 0 not in mine:
        model.tok_embeddings = None
    if n_stages - 1 not in mine:
        model.norm = None
        model.output = None
    return {s: [str(i) for i in stage_layers[s]] for s in mine}
