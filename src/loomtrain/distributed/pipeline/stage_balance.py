"""Stage boundaries for pipeline ranks that run at different speeds (heterogeneous clusters).

Cost model: layer ``l`` costs ``c_l`` (``layer_costs``; e.g. ``measure_layer_seconds`` averaged
over ranks, any unit) and pipeline rank ``r`` computes ``speed_r`` cost units per second, so a
rank spends ``(sum of c_l over its layers) / speed_r`` seconds of compute per step.

The loop, all pure functions on numbers (every pp rank holds the same :class:`StepRecord`, so
every rank computes the same answer without another collective):

1. :func:`stage_seconds`: measured compute seconds of each stage in one step.
2. :func:`rank_speeds`: each rank's speed, from the split it ran.
3. :func:`balanced_stages`: the split that minimises the slowest stage's time at those speeds.
4. :func:`predicted_step_s` for the current and the proposed split, and
   :func:`should_repartition`: move layers only for a gain above a threshold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loomtrain.distributed.pipeline.split import partition_layers

if TYPE_CHECKING:
    from loomtrain.distributed.pipeline.executor import StepRecord


def stage_seconds(record: StepRecord, n_stages: int) -> list[float]:
    """Per stage, the summed forward and backward durations over one step (all micro-batches).

    The executor takes an action's start after its input arrived, so each ``end - start`` is
    compute (plus the local send post), not waiting for a neighbour.

    Args:
        record: one step's :class:`StepRecord` (every pp rank's actions and ``(start, end)``
            wall-clock intervals in seconds). n_stages: ``pp * v``.

    Returns:
        ``n_stages`` seconds, stage ``s`` at index ``s``.

    Raises:
        ValueError: ``record.actions`` and ``record.intervals`` differ in ranks or in actions on
            a rank, or an action's stage is outside ``0..n_stages-1``.
    """
    if len(record.actions) != len(record.intervals):
        raise ValueError(
            f"StepRecord has actions of {len(record.actions)} ranks but intervals of {len(record.intervals)}"
        )
    seconds = [0.0] * n_stages
    for rank, (actions, spans) in enumerate(zip(record.actions, record.intervals, strict=True)):
        if len(actions) != len(spans):
            raise ValueError(f"StepRecord rank {rank} has {len(actions)} actions but {len(spans)} intervals")
        for action, (start, end) in zip(actions, spans, strict=True):
            if not 0 <= action.stage < n_stages:
                raise ValueError(f"rank {rank} ran {action}, outside n_stages={n_stages}; pass pp * v")
            seconds[action.stage] += end - start
    return seconds


def rank_speeds(stage_secs: list[float], stages: list[list[int]], layer_costs: list[float], pp: int) -> list[float]:
    """Per pipeline rank, its speed: cost of the layers it ran (all its stages) / its measured seconds.

    Why a speed relative to a cost model carries over to another split: under the model
    ``seconds_r = (sum of c_l over rank r's layers) / speed_r``, the ratio cost / seconds is a
    property of the rank's device alone. It does not depend on which layers the rank holds, so
    the time of any other split on that rank is its new cost / ``speed_r``. Raw seconds per
    stage are tied to the layers measured; raw seconds per layer need every layer timed on every
    device. Errors of the cost model that are the same on all of a rank's layers fold into its
    speed; embedding, head and loss time (not in ``layer_costs``) fold into the speed of the
    ranks holding the first and last stage.

    Args:
        stage_secs: seconds per stage over one step (:func:`stage_seconds`), ``pp * v`` entries.
        stages: the split that ran: layer indices of each stage (stage ``s`` on rank ``s % pp``).
        layer_costs: cost of each layer, any unit. pp: pipeline ranks.

    Returns:
        ``pp`` speeds in cost units per second (per step: the seconds cover all micro-batches).

    Raises:
        ValueError: ``stage_secs`` and ``stages`` differ in length or are not a multiple of
            ``pp``; a rank measured no time or ran layers of total cost 0.
    """
    if len(stage_secs) != len(stages) or pp < 1 or len(stages) % pp:
        raise ValueError(
            f"stage_secs ({len(stage_secs)}) and stages ({len(stages)}) must both have pp * v entries for pp={pp}"
        )
    speeds = []
    for rank in range(pp):
        cost = sum(layer_costs[layer] for stage in stages[rank::pp] for layer in stage)
        seconds = sum(stage_secs[rank::pp])
        if seconds <= 0 or cost <= 0:
            raise ValueError(
                f"pp rank {rank} measured {seconds} s for layers of cost {cost}; both must be above 0 "
                "(a record of a training step, and positive layer_costs)"
            )
        speeds.append(cost / seconds)
    return speeds


def balanced_stages(layer_costs: list[float], speeds_per_rank: list[float], pp: int, v: int) -> list[list[int]]:
    """The ``pp * v`` stages minimising the slowest stage's time ``cost / speed`` (exact, see
    ``split.partition_layers``); stage ``s`` runs at ``speeds_per_rank[s % pp]``.

    With ``v > 1`` a rank runs the sum of its ``v`` stages; balancing the slowest stage bounds
    that sum by ``v`` times it but need not minimise it (compare splits with
    :func:`predicted_step_s`).

    Args:
        layer_costs: cost of each layer (any unit). speeds_per_rank: ``pp`` speeds in cost
            units per second (:func:`rank_speeds`). pp, v: pipeline ranks and virtual stages.

    Raises:
        ValueError: ``speeds_per_rank`` not ``pp`` positive numbers, or fewer layers than stages.
    """
    _check_rank_speeds(speeds_per_rank, pp)
    n_stages = pp * v
    speeds = [speeds_per_rank[stage % pp] for stage in range(n_stages)]
    return partition_layers(len(layer_costs), n_stages, costs=layer_costs, stage_speeds=speeds)


def predicted_step_s(
    stages: list[list[int]], layer_costs: list[float], speeds_per_rank: list[float], n_micro: int, pp: int, v: int
) -> float:
    """Predicted compute time of one step of split ``stages``, zero communication time, in seconds.

    Per micro-batch, stage ``s`` takes ``t_s = (cost_s / speeds_per_rank[s % pp]) / n_micro``
    (``cost / speed`` is the whole step's seconds, as :func:`rank_speeds` measured them), and
    rank ``r`` takes ``T_r``, the sum of its ``v`` stages' ``t_s``. The step is

        ``n_micro · max_r T_r + (sum_s t_s - max_r T_r) / v``

    For ``v = 1`` (GPipe and 1F1B, flushed) that is ``sum_s t_s + (n_micro - 1) · max_s t_s``:
    fill and drain pass every stage once, and the slowest stage paces the remaining
    micro-batches. With equal ``t`` it is ``(n_micro + pp - 1) · t``, the bubble of ``pp - 1``
    slots (Huang et al., "GPipe", 2019, §2.3; Narayanan et al., SC 2021, §2.2.1). It is exact
    for GPipe when backward / forward is the same ratio on every stage (a flow line: the longest
    path runs through the slowest stage for every micro-batch). 1F1B hides part of the fill
    behind a slow stage under its warm-up forwards, so it can finish sooner: against
    ``schedule.simulate`` the formula was 4 % over on average, 22 % at worst, never under (300
    random cases, ``pp`` 2-4, stage times spread 10x).

    For ``v > 1`` (interleaved 1F1B) it is an approximation: with equal stages it is
    ``n_micro · T + (pp - 1) · T / v``, the bubble divided by ``v`` of Narayanan et al., SC 2021,
    §2.2.2, and exact; with unequal stages its error against ``schedule.simulate`` was 5 % on
    average, from 27 % under to 11 % over (300 random cases each for ``v`` 2 and 3, as above).

    Raises:
        ValueError: ``stages`` not ``pp * v`` entries, ``n_micro`` below 1, or
            ``speeds_per_rank`` not ``pp`` positive numbers.
    """
    _check_rank_speeds(speeds_per_rank, pp)
    if len(stages) != pp * v or n_micro < 1:
        raise ValueError(f"need pp * v = {pp * v} stages (got {len(stages)}) and n_micro >= 1 (got {n_micro})")
    t = [
        sum(layer_costs[layer] for layer in stage) / speeds_per_rank[s % pp] / n_micro for s, stage in enumerate(stages)
    ]
    slowest = max(sum(t[rank::pp]) for rank in range(pp))
    return n_micro * slowest + (sum(t) - slowest) / v


def should_repartition(current_s: float, proposed_s: float, threshold: float) -> bool:
    """True when ``proposed_s`` is below ``current_s`` by at least ``threshold`` of it.

    Hysteresis: moving layers costs a re-shard of weights and optimizer state, and measured
    speeds are noisy, so a small predicted gain does not move layers.

    Args:
        current_s, proposed_s: predicted step seconds (:func:`predicted_step_s`) of the split
            now running and of the proposed one. threshold: relative gain, e.g. 0.05 for 5 %.

    Raises:
        ValueError: ``threshold`` outside ``[0, 1)``.
    """
    if not 0 <= threshold < 1:
        raise ValueError(f"threshold={threshold} is a relative gain; give a number in [0, 1), e.g. 0.05")
    return proposed_s < current_s and current_s - proposed_s >= threshold * current_s


def _check_rank_speeds(speeds_per_rank: list[float], pp: int) -> None:
    """Raise ValueError unless ``speeds_per_rank`` is ``pp`` numbers above 0."""
    if len(speeds_per_rank) != pp or not all(speed > 0 for speed in speeds_per_rank):
        raise ValueError(f"speeds_per_rank {speeds_per_rank} must be pp={pp} speeds above 0 (see rank_speeds)")
