"""Speed-aware stage split and the measure -> speeds -> split -> predicted step loop (heterogeneous pipelines)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from loomtrain.distributed.pipeline.executor import StepRecord
from loomtrain.distributed.pipeline.schedule import bubble_fraction, build_schedule, simulate
from loomtrain.distributed.pipeline.split import partition_layers
from loomtrain.distributed.pipeline.stage_balance import (
    balanced_stages,
    predicted_step_s,
    rank_speeds,
    should_repartition,
    stage_seconds,
)


def slowest(stages: list[list[int]], costs: list[float], speeds: list[float]) -> float:
    """The largest cost / speed over the stages."""
    return max(sum(costs[i] for i in stage) / speed for stage, speed in zip(stages, speeds, strict=True))


def brute_force_slowest(costs: list[float], speeds: list[float]) -> float:
    """The smallest slowest-stage time over every contiguous split, cut points enumerated."""
    n = len(costs)
    return min(
        slowest([list(range(a, b)) for a, b in zip((0, *cuts), (*cuts, n), strict=True)], costs, speeds)
        for cuts in itertools.combinations(range(1, n), len(speeds) - 1)
    )


def measured_record(schedule_name: str, pp: int, v: int, n_micro: int, stage_times: list[float]) -> StepRecord:
    """A StepRecord of intervals replayed by ``schedule.simulate``; stage ``s`` takes
    ``stage_times[s]`` seconds per micro-batch, a third forward and two thirds backward."""
    times = {(kind, s): t * share for s, t in enumerate(stage_times) for kind, share in (("F", 1 / 3), ("B", 2 / 3))}
    timeline = simulate(build_schedule(schedule_name, pp, n_micro, v), pp, v, stage_times=times)
    actions = [[a for a, _, _ in rank] for rank in timeline]
    spans = [[(start, end) for _, start, end in rank] for rank in timeline]
    return StepRecord(actions, spans, bubble_fraction(spans))


def simulated_step(schedule_name: str, pp: int, v: int, n_micro: int, stage_times: list[float]) -> float:
    """The step time of the replayed schedule: its last action's end."""
    record = measured_record(schedule_name, pp, v, n_micro, stage_times)
    return max(end for rank in record.intervals for _, end in rank)


def test_half_speed_rank_gets_five_of_sixteen_equal_layers():
    """Catches: speeds ignored (8 : 8) or applied inverted (5 : 11) on a rank at half speed,
    also when no costs are given (every layer then costs 1)."""
    stages = partition_layers(16, 2, costs=[1.0] * 16, stage_speeds=[1.0, 0.5])
    assert [len(s) for s in stages] == [11, 5]
    assert partition_layers(16, 2, stage_speeds=[1.0, 0.5]) == stages
    assert balanced_stages([1.0] * 16, [1.0, 0.5], pp=2, v=1) == stages
    assert slowest(stages, [1.0] * 16, [1.0, 0.5]) == brute_force_slowest([1.0] * 16, [1.0, 0.5]) == 11.0


def test_speed_aware_split_is_optimal_by_brute_force():
    """Catches: a DP that pairs a run with the wrong stage's speed, or misses the optimum, for
    random costs and speeds, pp 2-4, v 1-2 (stage s at the speed of rank s % pp)."""
    rng = random.Random(15)
    for pp, v in itertools.product((2, 3, 4), (1, 2)):
        for _ in range(3):
            n_stages = pp * v
            costs = [rng.uniform(0.1, 3.0) for _ in range(rng.randint(n_stages, n_stages + 4))]
            rank_speed = [rng.uniform(0.25, 2.0) for _ in range(pp)]
            speeds = [rank_speed[s % pp] for s in range(n_stages)]
            stages = balanced_stages(costs, rank_speed, pp, v)
            assert [i for s in stages for i in s] == list(range(len(costs))) and all(stages)
            assert slowest(stages, costs, speeds) == pytest.approx(brute_force_slowest(costs, speeds), rel=1e-12)


@pytest.mark.parametrize(
    "n_layers, n_stages, costs, expected",
    [
        # Results of partition_layers before stage_speeds existed, ties included.
        (7, 3, [1.0] * 7, [[0, 1], [2, 3], [4, 5, 6]]),
        (8, 4, [1.0] * 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (6, 2, [3.0, 1.0, 1.0, 1.0, 1.0, 3.0], [[0, 1, 2], [3, 4, 5]]),
        (9, 3, [2.0, 2.0, 1.0, 5.0, 1.0, 1.0, 3.0, 3.0, 0.5], [[0, 1, 2], [3, 4, 5], [6, 7, 8]]),
        (10, 4, [0.1, 0.3, 0.2, 0.9, 0.4, 0.4, 0.8, 0.1, 0.6, 0.5], [[0, 1, 2], [3, 4], [5, 6], [7, 8, 9]]),
    ],
)
def test_without_speeds_the_split_is_unchanged(n_layers, n_stages, costs, expected):
    """Catches: the speed-aware DP changing splits (or tie-breaks) of configs that give no speeds;
    equal speeds must also give the same split."""
    assert partition_layers(n_layers, n_stages, costs=costs) == expected
    assert partition_layers(n_layers, n_stages, costs=costs, stage_speeds=[1.0] * n_stages) == expected
    assert partition_layers(n_layers, n_stages, costs=costs, stage_speeds=[0.3] * n_stages) == expected


def test_measured_record_gives_stage_seconds_and_relative_speeds():
    """Catches: stage time taken from one micro-batch or one action kind, a rank's v stages not
    summed, or speed computed as seconds / cost: a rank at half speed must come out at half."""
    # pp = 2, v = 2, 4 micro-batches; 8 equal layers, 2 per stage; rank 1 runs at half speed.
    stages = [[0, 1], [2, 3], [4, 5], [6, 7]]
    per_micro = [2.0, 4.0, 2.0, 4.0]  # cost 2 per stage at speeds 1 and 0.5
    record = measured_record("interleaved_1f1b", pp=2, v=2, n_micro=4, stage_times=per_micro)
    secs = stage_seconds(record, 4)
    assert secs == pytest.approx([8.0, 16.0, 8.0, 16.0], rel=1e-12)
    speeds = rank_speeds(secs, stages, [1.0] * 8, pp=2)
    assert speeds == pytest.approx([4 / 16, 4 / 32], rel=1e-12)  # cost units per second of the step


def test_loop_from_measured_step_moves_layers_to_the_fast_rank():
    """Catches: a loop that does not close: speeds measured on an 8 : 8 split must give the
    11 : 5 split, and the predictions must match the replayed GPipe step of both splits."""
    costs, n_micro = [1.0] * 16, 4
    before = partition_layers(16, 2)
    record = measured_record("gpipe", pp=2, v=1, n_micro=n_micro, stage_times=[8.0, 16.0])
    speeds = rank_speeds(stage_seconds(record, 2), before, costs, pp=2)
    after = balanced_stages(costs, speeds, pp=2, v=1)
    assert [len(s) for s in after] == [11, 5]
    current = predicted_step_s(before, costs, speeds, n_micro, pp=2, v=1)
    proposed = predicted_step_s(after, costs, speeds, n_micro, pp=2, v=1)
    assert current == pytest.approx(simulated_step("gpipe", 2, 1, n_micro, [8.0, 16.0]), rel=1e-12)
    assert proposed == pytest.approx(simulated_step("gpipe", 2, 1, n_micro, [11.0, 10.0]), rel=1e-12)
    assert (current, proposed) == pytest.approx((72.0, 54.0), rel=1e-12)
    assert should_repartition(current, proposed, 0.05)


def test_predicted_step_equal_stages_has_pp_minus_one_bubble_slots():
    """Catches: a fill/drain term off by one stage, or t taken per step instead of per micro-batch:
    equal stages of t seconds give (n_micro + pp - 1) * t; interleaved divides the bubble by v."""
    # 8 layers of cost 1 at speed 1 over 8 micro-batches: 2 layers a stage is t = 0.25 s.
    assert predicted_step_s(partition_layers(8, 4), [1.0] * 8, [1.0] * 4, 8, pp=4, v=1) == pytest.approx(11 * 0.25)
    # pp = 2, v = 2, 4 micro-batches, stage t = 0.5 s, rank T = 1 s: 4 * 1 + (2 - 1) * 1 / 2.
    interleaved = predicted_step_s(partition_layers(8, 4), [1.0] * 8, [1.0, 1.0], 4, pp=2, v=2)
    assert interleaved == pytest.approx(4.5)
    assert interleaved == pytest.approx(simulated_step("interleaved_1f1b", 2, 2, 4, [0.5] * 4))


def test_predicted_step_unequal_stages_by_hand_and_by_replay():
    """Catches: the max term using the mean stage or the wrong rank's speed: stage times
    2, 1, 3 s per micro-batch over 4 micro-batches give 6 + 3 * 3 = 15 s, as GPipe replays it."""
    stages, costs, speeds = [[0], [1, 2], [3]], [8.0, 4.0, 4.0, 12.0], [1.0, 2.0, 1.0]
    assert predicted_step_s(stages, costs, speeds, 4, pp=3, v=1) == pytest.approx(15.0)
    assert simulated_step("gpipe", 3, 1, 4, [2.0, 1.0, 3.0]) == pytest.approx(15.0)
    rng = random.Random(7)
    for _ in range(5):
        times = [rng.uniform(0.2, 2.0) for _ in range(4)]
        predicted = predicted_step_s([[s] for s in range(4)], [t * 6 for t in times], [1.0] * 4, 6, pp=4, v=1)
        assert predicted == pytest.approx(simulated_step("gpipe", 4, 1, 6, times), rel=1e-12)


def test_should_repartition_needs_the_threshold_gain():
    """Catches: hysteresis dropped (any gain moves layers), inverted, or absolute instead of relative."""
    assert should_repartition(8.0, 6.0, 0.25)
    assert not should_repartition(8.0, 6.1, 0.25)
    assert should_repartition(100.0, 90.0, 0.05) and not should_repartition(100.0, 96.0, 0.05)
    assert not should_repartition(8.0, 8.0, 0.0) and not should_repartition(8.0, 9.0, 0.05)
    with pytest.raises(ValueError, match="threshold"):
        should_repartition(8.0, 6.0, 5.0)


@pytest.mark.parametrize(
    "speeds, needle",
    [([1.0], "has 1 entries; give one per stage \\(2\\)"), ([1.0, 0.0], "stage 1 has 0.0"),
     ([-1.0, 1.0], "stage 0 has -1.0"), ([1.0, math.nan], "above 0"), ([math.inf, 1.0], "finite")],
)  # fmt: skip
def test_bad_stage_speeds_are_refused(speeds, needle):
    """Catches: a zero, negative, NaN or infinite speed, or one per rank instead of per stage,
    silently giving a split (division by zero or a meaningless optimum)."""
    with pytest.raises(ValueError, match=needle):
        partition_layers(4, 2, costs=[1.0] * 4, stage_speeds=speeds)


def test_bad_measurements_are_refused():
    """Catches: a record of the wrong pipeline shape, or a rank with no measured time, turned into
    a division by zero or a wrong speed instead of an error naming the problem."""
    record = measured_record("1f1b", pp=2, v=1, n_micro=2, stage_times=[1.0, 1.0])
    with pytest.raises(ValueError, match="outside n_stages=1"):
        stage_seconds(record, 1)
    with pytest.raises(ValueError, match="pp rank 1 measured 0.0 s"):
        rank_speeds([1.0, 0.0], [[0], [1]], [1.0, 1.0], pp=2)
    with pytest.raises(ValueError, match="pp \\* v entries"):
        rank_speeds([1.0, 1.0, 1.0], [[0], [1], [2]], [1.0] * 3, pp=2)
    with pytest.raises(ValueError, match="pp=2 speeds above 0"):
        balanced_stages([1.0] * 4, [1.0], pp=2, v=1)
