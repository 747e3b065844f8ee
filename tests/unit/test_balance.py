"""The data-parallel split: its optimality, bounds and hysteresis, and the loader's layout of it."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from loomtrain.data.loader import DistributedBatchLoader
from loomtrain.distributed.balance import (
    DataBalancer,
    PipelineBalancer,
    RankMeasure,
    balanced_split,
    predicted_step_s,
)
from loomtrain.distributed.pipeline.executor import StepRecord
from loomtrain.distributed.pipeline.schedule import Action


def brute_force_best(total: int, seconds: list[float], low: int, high: int) -> float:
    splits = (s for s in itertools.product(range(low, high + 1), repeat=len(seconds)) if sum(s) == total)
    return min(predicted_step_s(list(s), seconds) for s in splits)


def test_split_is_optimal_against_brute_force():
    """Catches: a proportional rounding that leaves a rank one sample too many (the step then
    waits on it), or bounds that are ignored."""
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(2, 4)
        seconds = [rng.uniform(0.1, 2.0) for _ in range(n)]
        low, high = rng.randint(1, 3), rng.randint(6, 12)
        total = rng.randint(low * n, high * n)
        split = balanced_split(total, seconds, low, high)
        assert sum(split) == total and all(low <= x <= high for x in split), split
        assert predicted_step_s(split, seconds) == pytest.approx(brute_force_best(total, seconds, low, high))


def test_speeds_one_to_half_split_two_to_one():
    """Catches: a split proportional to time instead of speed (the slow rank would get more)."""
    assert balanced_split(120, [1.0, 2.0], 1, 120) == [80, 40]
    assert balanced_split(120, [1 / 0.72, 1 / 0.54, 1 / 0.36, 1 / 0.18], 1, 120) == [48, 36, 24, 12]


def test_bounds_that_cannot_hold_the_batch_are_refused():
    """Catches: a split that silently drops samples when the memory limit is too low."""
    with pytest.raises(ValueError, match="cannot be split"):
        balanced_split(10, [1.0, 1.0], 1, 4)


def measures(*seconds: float) -> list[RankMeasure]:
    return [RankMeasure(s, 0.0, 0) for s in seconds]


def test_balancer_moves_only_for_a_gain_above_threshold():
    """Catches: a balancer without hysteresis that moves samples on measurement noise, and one
    that never moves."""
    b = DataBalancer(global_batch=24, dp=2, micro_batches=2, max_micro_batch_size=0, threshold=0.1)
    assert b.split == [12, 12]
    assert b.decide(10, measures(1.0, 1.05)) is None  # ~5 % gain only
    decision = b.decide(20, measures(1.0, 2.0))
    assert decision is not None and decision.before == [12, 12] and decision.after == [16, 8] == b.split
    assert decision.predicted_after_s < decision.predicted_before_s
    assert b.decide(30, measures(1.0, 2.0)) is None


def test_balancer_respects_micro_batches_and_memory_limit():
    """Catches: a rank given fewer samples than micro-batches (an empty micro-batch, then a
    mismatched number of collectives) or more than its memory allows."""
    b = DataBalancer(global_batch=24, dp=2, micro_batches=4, max_micro_batch_size=4, threshold=0.01)
    b.decide(1, measures(1.0, 100.0))
    assert b.split == [16, 8]  # the fast rank is capped at 4 micro-batches × 4
    b = DataBalancer(global_batch=24, dp=2, micro_batches=4, max_micro_batch_size=0, threshold=0.01)
    b.decide(1, measures(1.0, 100.0))
    assert b.split == [20, 4]


def test_fixed_split_never_changes_and_state_round_trips():
    """Catches: a hand-set split overridden by measurements, a resumed balancer that forgets its
    split, and a saved split of another dp degree applied to this one."""
    fixed = DataBalancer(8, 2, 1, 0, 0.05, fixed=[5, 3])
    assert fixed.decide(1, measures(1.0, 10.0)) is None and fixed.split == [5, 3]
    b = DataBalancer(8, 2, 1, 0, 0.05)
    b.decide(1, measures(1.0, 3.0))
    restored = DataBalancer(8, 2, 1, 0, 0.05)
    restored.load_state_dict(b.state_dict())
    assert restored.split == b.split == [6, 2] and restored.rebalances == 1
    other = DataBalancer(8, 4, 1, 0, 0.05)
    other.load_state_dict(b.state_dict())
    assert other.split == [2, 2, 2, 2]


def test_loader_split_covers_the_global_batch_once_with_equal_micro_batch_counts():
    """Catches: ranks that overlap or skip batch positions under a split, micro-batch sizes that
    differ by more than one, and ranks with different numbers of micro-batches."""
    tokens = torch.arange(2000)
    split = [7, 3, 2]
    loaders = [DistributedBatchLoader(tokens, 8, 12, 2, r, 3, seed=0) for r in range(3)]
    uniform = DistributedBatchLoader(tokens, 8, 12, 2, 0, 1, seed=0)
    for _ in range(3):
        steps = [loader.next_step(split) for loader in loaders]
        assert all(len(s) == 2 for s in steps)  # 12 / (3 ranks × micro-batch 2)
        seen = sorted(w for loader in loaders for mb in loader.last_sample_ids for w in mb)
        uniform.next_step()
        assert seen == sorted(w for mb in uniform.last_sample_ids for w in mb)
        for rank, step in enumerate(steps):
            sizes = [x.shape[0] for x, _ in step]
            assert sum(sizes) == split[rank] and max(sizes) - min(sizes) <= 1


def test_loader_refuses_a_split_that_does_not_fit():
    """Catches: a split of the wrong total or with fewer samples than micro-batches accepted."""
    loader = DistributedBatchLoader(torch.arange(2000), 8, 8, 2, 0, 2, seed=0)
    with pytest.raises(ValueError, match="8 in all"):
        loader.next_step([4, 3])
    with pytest.raises(ValueError, match="micro-batches"):
        loader.next_step([1, 7])


def test_pipeline_balancer_moves_to_the_fast_rank_and_never_straight_back():
    """Catches: layers moved toward the slow rank, and two splits swapped at every decision when
    the measured speeds depend on the split (an idle throttled rank runs faster)."""
    b = PipelineBalancer(16, pp=2, v=1, n_micro=16, boundaries=[], threshold=0.05, smoothing=0.5)
    decision = b.decide(5, [8.0, 16.0])  # 8 layers each; rank 1 at half speed
    assert decision is not None and decision.before == [8] and decision.after == [11] == b.boundaries
    assert b.decide(10, [11.0, 5.0]) is None  # equal speeds now: back to [8] is refused
    assert b.boundaries == [11]


def test_pipeline_balancer_drops_the_warm_up_step_after_a_move():
    """Catches: the first step on rebuilt stages (lazy allocation) folded into the stage times,
    which charges one rank for a warm-up and can send layers back and forth."""
    b = PipelineBalancer(4, pp=2, v=1, n_micro=8, boundaries=[1], threshold=0.05, smoothing=0.5)

    def record(stage_0_s: float, stage_1_s: float) -> StepRecord:
        actions = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]
        return StepRecord(actions, [[(0.0, stage_0_s / 2)] * 2, [(0.0, stage_1_s / 2)] * 2], 0.0)

    b.record(record(1.0, 3.0))  # 1 : 3 on equal ranks: rank 1 three times as long
    decision = b.decide(2, b.seconds)
    assert decision is not None and decision.after == [2]
    b.record(record(50.0, 1.0))  # the warm-up step on the new split: dropped
    assert b.seconds is None
    b.record(record(2.0, 2.0))
    assert b.seconds == [2.0, 2.0]
