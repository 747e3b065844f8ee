"""The pure parts of ``loomtrain.cluster.throttle``: which core each throttled rank gets, and
``simulate.speed_change`` parsing, the retry of a group's set-up (no root, no cgroups)."""

from __future__ import annotations

import errno

import pytest

from loomtrain.cluster import throttle
from loomtrain.cluster.throttle import CORE_CAP, SpeedChange, parse_speed_changes, plan_cores
from loomtrain.config import ConfigError


def core_loads(speeds: list[float], plan: list[int], n_cores: int) -> list[float]:
    return [sum(s for s, c in zip(speeds, plan, strict=True) if c == core) for core in range(n_cores)]


def test_benchmark_speeds_pair_fastest_with_slowest():
    """Catches: a plan that puts 0.72 and 0.54 on different cores but leaves a core over the
    cap, or pairs 0.72 with 0.36 (1.08 on one core, so a rank waits for another)."""
    speeds = [0.72, 0.54, 0.36, 0.18]
    plan = plan_cores(speeds, 2)
    assert plan == [0, 1, 1, 0]
    assert all(load <= CORE_CAP + 1e-9 for load in core_loads(speeds, plan, 2))


def test_plan_spreads_and_is_deterministic():
    """Catches: first-fit stacking every rank on core 0 while other cores idle, ties broken by
    something other than rank order (a plan that differs between ranks of one job), and a
    packable input refused because worst fit alone failed."""
    assert plan_cores([0.3, 0.3, 0.3, 0.3], 4) == [0, 1, 2, 3]
    assert plan_cores([0.25, 0.5, 0.25], 2) == [1, 0, 1]
    speeds = [0.5, 0.5, 0.4, 0.3, 0.3]  # worst fit leaves 0.1 + 0.2 free: only first fit packs it
    plan = plan_cores(speeds, 2, cap=1.0)
    assert core_loads(speeds, plan, 2) == pytest.approx([1.0, 1.0])
    assert plan_cores([], 2) == []


def test_overfull_machine_refused_with_total_and_capacity():
    """Catches: ranks silently oversubscribing a core (their speeds would be wrong), and a
    message that does not say how far over the machine is."""
    with pytest.raises(ValueError, match=r"simulate.rank_speed sums to 1.9 .* more than the 1.8 that 2 cores"):
        plan_cores([0.5, 0.5, 0.5, 0.4], 2)
    with pytest.raises(ValueError, match=r"sums to 1.6, within the 1.8 .* no split into 2 cores"):
        plan_cores([0.6, 0.5, 0.5], 2)  # any two of them exceed 0.9
    with pytest.raises(ValueError, match="at least one core"):
        plan_cores([0.5], 0)


@pytest.mark.parametrize(
    ("speed", "needle"),
    [(0.0, "below 0.1"), (-0.3, "below 0.1"), (0.05, "smallest CFS quota"), (0.95, "more than 0.9"),
     (float("nan"), "not a number")],
)  # fmt: skip
def test_invalid_speed_names_the_rank(speed, needle):
    """Catches: a zero, negative or NaN speed reaching the kernel (EINVAL mid-run, or an
    unthrottled rank), a speed below the kernel's 1 ms quota, or one above the core cap."""
    with pytest.raises(ValueError, match=r"simulate.rank_speed\[1\]") as e:
        plan_cores([0.5, speed], 2)
    assert needle in str(e.value)


def test_speed_changes_parse():
    """Catches: fields read in the wrong order, or a speed parsed as an integer."""
    assert parse_speed_changes(["200:1:0.25", " 5:0:0.9"]) == [SpeedChange(200, 1, 0.25), SpeedChange(5, 0, 0.9)]
    assert parse_speed_changes([]) == []


@pytest.mark.parametrize(
    ("entry", "needle"),
    [("200:1", "has 2 fields, not 3"), ("200:1:0.25:3", "has 4 fields"), ("2.5:1:0.25", "integers"),
     ("200:x:0.25", "integers"), ("0:1:0.25", "steps count from 1"), ("200:-1:0.25", "ranks count from 0"),
     ("200:1:0", "below 0.1"), ("200:1:-2", "below 0.1"), ("200:1:fast", "integers"), ("9:1:1.5", "more than 0.9")],
)  # fmt: skip
def test_bad_speed_change_names_field_and_format(entry, needle):
    """Catches: a malformed entry accepted (applied to the wrong step or rank) or failing with a
    bare int()/float() error that does not say where or what the format is."""
    with pytest.raises(ValueError, match=r"simulate.speed_change\[1\]") as e:
        parse_speed_changes(["10:0:0.5", entry])
    assert needle in str(e.value) and 'write "step:rank:speed", e.g. "200:1:0.25"' in str(e.value)


def test_group_is_made_again_when_a_sweep_removed_its_parent_mid_setup(tmp_path, monkeypatch):
    """Catches: a throttled rank failing its start with ENODEV (seen in test_balance_train) when
    another rank's sweep removed the empty ``loomtrain`` parent between our ``mkdir`` of it and
    the write of its weight: cgroupfs then answers ENODEV, not ENOENT, and must be retried too."""
    ctrl = throttle._Controller(tmp_path, 1)
    failures = [OSError(errno.ENODEV, "No such device")]

    def make_parent(c):
        c.parent.mkdir(exist_ok=True)
        if failures:
            raise failures.pop()

    monkeypatch.setattr(throttle, "_make_parent", make_parent)
    assert throttle._make_group(ctrl, "loomtrain-x@1.2") == tmp_path / throttle.PARENT / "loomtrain-x@1.2"
    assert not failures


def test_a_group_that_exists_already_is_refused_with_the_fix(tmp_path):
    """Catches: the ENODEV retry swallowing FileExistsError (an OSError too) ahead of its own
    handler, so a second throttle of one process raised a bare FileExistsError instead of the
    error that says to close the first."""
    ctrl = throttle._Controller(tmp_path, 1)
    (tmp_path / throttle.PARENT / "loomtrain-x@1.2").mkdir(parents=True)
    with pytest.raises(ConfigError, match="already throttled with this tag; close it first"):
        throttle._make_group(ctrl, "loomtrain-x@1.2")
