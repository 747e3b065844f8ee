"""Pipeline schedules as data: completeness, causality, deadlock freedom, FIFO channels, bubbles."""

from __future__ import annotations

import pytest

from loomtrain.distributed.pipeline.schedule import (
    SCHEDULES,
    Action,
    ScheduleError,
    bubble_fraction,
    build_schedule,
    check_schedule,
    format_schedule,
    forward_only_schedule,
    peak_in_flight,
    rank_stages,
    shared_core_makespan,
    simulate,
    stage_rank,
    theoretical_bubble,
)

MICRO_BATCHES = (1, 2, 3, 4, 8)


def _configs() -> list[tuple[str, int, int, int]]:
    """Every valid (name, pp, n_micro, v) the tests sweep."""
    configs = [(name, pp, m, 1) for name in ("gpipe", "1f1b") for pp in (1, 2, 4) for m in MICRO_BATCHES]
    configs += [("interleaved_1f1b", pp, m, v) for pp in (2, 4) for v in (2, 3) for m in MICRO_BATCHES if m % pp == 0]
    return configs


def _busy(timeline: list[list[tuple[Action, float, float]]]) -> list[list[tuple[float, float]]]:
    return [[(start, end) for _, start, end in rank] for rank in timeline]


def test_looping_placement_puts_stage_s_on_rank_s_mod_pp():
    """Catches a blocked placement (consecutive stages on one rank), which the executor does not expect."""
    assert rank_stages(1, pp=4, v=3) == [1, 5, 9]
    assert [stage_rank(s, 4) for s in rank_stages(1, pp=4, v=3)] == [1, 1, 1]


def test_action_prints_micro_batch_then_stage():
    """Catches swapped fields in the text the schedule dumps and error messages show."""
    assert str(Action("F", 1, 3)) == "F3s1"


@pytest.mark.parametrize(("name", "pp", "m", "v"), _configs())
def test_every_built_schedule_is_complete_causal_deadlock_free_and_fifo(name, pp, m, v):
    """Catches a schedule that hangs (e.g. 1F1B warm-up not capped for m < pp), runs a B before its F,
    or pairs the wrong messages on a channel; build_schedule checks, check again explicitly."""
    schedule = build_schedule(name, pp, m, v)
    check_schedule(schedule, pp, m, v)
    assert all(len(actions) == 2 * m * v for actions in schedule)


@pytest.mark.parametrize(("name", "pp", "m", "v"), _configs())
def test_simulated_bubble_equals_theory(name, pp, m, v):
    """Catches a warm-up count or chunk order that leaves more idle time than the papers' formulas
    ((p-1)/(m+p-1); interleaved (p-1)/(vm+p-1), Megatron SC 2021 §2.2.2); exact with t_b = 2 t_f."""
    schedule = build_schedule(name, pp, m, v)
    measured = bubble_fraction(_busy(simulate(schedule, pp, v, forward_time=1.0, backward_time=2.0)))
    assert measured == pytest.approx(theoretical_bubble(name, pp, m, v), abs=1e-9)


def test_interleaving_divides_the_bubble():
    """Catches an interleaved schedule that is merely correct but no faster than 1F1B."""
    one = theoretical_bubble("1f1b", pp=4, n_micro=8)
    two = theoretical_bubble("interleaved_1f1b", pp=4, n_micro=8, v=2)
    assert two < one
    assert two == pytest.approx(3 / 19)


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_1f1b_keeps_at_most_pp_micro_batches_in_flight_and_gpipe_keeps_all(pp, m):
    """Catches a 1F1B that degenerates to GPipe's activation memory (m micro-batches in flight)."""
    one_f_one_b = build_schedule("1f1b", pp, m)
    assert all(peak_in_flight(actions) <= pp for actions in one_f_one_b)
    assert peak_in_flight(one_f_one_b[0]) == min(pp, m)
    assert all(peak_in_flight(actions) == m for actions in build_schedule("gpipe", pp, m))


def test_1f1b_warm_up_is_capped_by_the_micro_batch_count():
    """Catches a warm-up of pp - r - 1 that is not capped by m (it asks for micro-batches that do not
    exist, the case that hangs in torchtitan)."""
    schedule = build_schedule("1f1b", pp=4, n_micro=2)
    assert format_schedule(schedule).splitlines()[0].split()[2:] == "F0s0 F1s0 B0s0 B1s0".split()
    assert format_schedule(schedule).splitlines()[3].split()[2:] == "F0s3 B0s3 F1s3 B1s3".split()


def test_interleaved_orders_follow_megatron():
    """Catches a wrong chunk or micro-batch formula: groups of pp micro-batches per chunk, backwards
    through the chunks in reverse, warm-up (pp - r - 1) * 2 + (v - 1) * pp."""
    schedule = build_schedule("interleaved_1f1b", pp=2, n_micro=4, v=2)
    text = format_schedule(schedule).splitlines()
    assert (
        text[0].split()
        == "rank 0: F0s0 F1s0 F0s2 F1s2 F2s0 B0s2 F3s0 B1s2 F2s2 B0s0 F3s2 B1s0 B2s2 B3s2 B2s0 B3s0".split()
    )
    assert (
        text[1].split()
        == "rank 1: F0s1 F1s1 F0s3 B0s3 F1s3 B1s3 F2s1 B0s1 F3s1 B1s1 F2s3 B2s3 F3s3 B3s3 B2s1 B3s1".split()
    )


def test_format_schedule_is_one_aligned_line_per_rank():
    """Catches a dump that mixes ranks or misaligns columns between ranks."""
    lines = format_schedule(build_schedule("1f1b", 2, 12)).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("rank 0: F0s0 ")
    starts = [[i for i in range(1, len(line)) if line[i - 1] == " " != line[i]] for line in lines]
    assert starts[0] == starts[1]


def _one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    return [list(actions) for actions in build_schedule("1f1b", pp, m)]


def test_check_catches_backward_before_forward():
    """Catches a rank that would run a backward without the activations of its forward."""
    schedule = _one_f_one_b(2, 4)
    schedule[1][0], schedule[1][1] = schedule[1][1], schedule[1][0]
    with pytest.raises(ScheduleError, match="rank 1 runs B0s1 before F0s1"):
        check_schedule(schedule, 2, 4)


def test_check_catches_deadlock_and_names_what_each_rank_waits_for():
    """Catches a cyclic wait: rank 0 takes B0 before sending F1's activation while rank 1 wants F1's
    activation before it computes B0 and sends its gradient. Each list alone looks valid."""
    schedule = _one_f_one_b(2, 4)
    schedule[0][1], schedule[0][2] = schedule[0][2], schedule[0][1]  # rank 0: F0 B0 F1 ...
    schedule[1][1], schedule[1][2] = schedule[1][2], schedule[1][1]  # rank 1: F0 F1 B0 ...
    with pytest.raises(ScheduleError, match="deadlocks") as error:
        check_schedule(schedule, 2, 4)
    assert "rank 0 waits at B0s0 for the gradient of B0s1 from rank 1" in str(error.value)
    assert "rank 1 waits at F1s1 for the activation of F1s0 from rank 0" in str(error.value)


def test_check_catches_missing_and_duplicated_actions():
    """Catches a dropped micro-batch (its gradient never accumulates) and a repeated one."""
    schedule = _one_f_one_b(2, 4)
    schedule[1].remove(Action("B", 1, 3))
    with pytest.raises(ScheduleError, match="missing: B3s1"):
        check_schedule(schedule, 2, 4)
    schedule[1].append(Action("B", 1, 2))
    with pytest.raises(ScheduleError, match="duplicated: B2s1"):
        check_schedule(schedule, 2, 4)


def test_check_catches_channel_order_mismatch():
    """Catches FIFO mis-pairing: rank 0 sends mb 1 before mb 0, so without tags rank 1 would take mb 1's
    activation as mb 0's. Nothing hangs; only the channel check sees it."""
    schedule = _one_f_one_b(2, 4)
    schedule[0][0], schedule[0][1] = schedule[0][1], schedule[0][0]
    with pytest.raises(ScheduleError, match=r"channel rank 0 -> rank 1 \(activation\)"):
        check_schedule(schedule, 2, 4)


def test_check_catches_action_on_a_stage_the_rank_does_not_own():
    """Catches a schedule built for another placement (e.g. blocked instead of looping)."""
    schedule = _one_f_one_b(2, 2)
    schedule[0][0] = Action("F", 1, 0)
    with pytest.raises(ScheduleError, match=r"rank 0 holds F0s1 but owns only stages \[0\]"):
        check_schedule(schedule, 2, 2)


@pytest.mark.parametrize(
    ("name", "pp", "m", "v", "field"),
    [
        ("interleaved_1f1b", 3, 4, 2, "parallel.pipeline_parallel_degree=3"),
        ("interleaved_1f1b", 2, 4, 1, "parallel.virtual_stages"),
        ("1f1b", 2, 4, 2, "parallel.virtual_stages=2 needs parallel.pipeline_schedule='interleaved_1f1b'"),
        ("gpipe", 2, 4, 2, "parallel.virtual_stages=2"),
        ("zero_bubble", 2, 4, 1, "parallel.pipeline_schedule='zero_bubble'"),
        ("1f1b", 0, 4, 1, "parallel.pipeline_parallel_degree=0"),
        ("1f1b", 2, 0, 1, "training.global_batch_size"),
    ],
)
def test_build_refuses_bad_configs_naming_the_field(name, pp, m, v, field):
    """Catches a bad config surfacing as a hang or an index error at step 1 instead of a fixable message."""
    with pytest.raises(ScheduleError) as error:
        build_schedule(name, pp, m, v)
    assert field in str(error.value)


def test_interleaved_micro_batch_error_says_how_to_fix_it():
    """Catches a message that names the problem but not the config knobs that fix it."""
    with pytest.raises(ScheduleError) as error:
        build_schedule("interleaved_1f1b", 3, 4, 2)
    assert "micro-batches per step (4)" in str(error.value)
    assert "training.global_batch_size or training.micro_batch_size" in str(error.value)


def test_unknown_schedule_lists_the_choices():
    """Catches an error that leaves the user guessing the valid names."""
    with pytest.raises(ScheduleError) as error:
        build_schedule("zero_bubble", 2, 4)
    assert all(name in str(error.value) for name in SCHEDULES)


@pytest.mark.parametrize(("pp", "v"), [(1, 1), (2, 1), (4, 1), (2, 2), (4, 3), (3, 2)])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_forward_only_schedule_runs_for_any_micro_batch_count(pp, v, m):
    """Catches an evaluation order that deadlocks or mis-pairs channels, notably with m < pp or m not a
    multiple of pp, which training schedules may refuse."""
    schedule = forward_only_schedule(pp, m, v)
    check_schedule(schedule, pp, m, v, forward_only=True)
    assert all(action.kind == "F" for actions in schedule for action in actions)


def test_forward_only_check_rejects_backwards():
    """Catches a training schedule passed where evaluation (no autograd graph) is expected."""
    with pytest.raises(ScheduleError, match="unexpected: B0s0"):
        check_schedule(build_schedule("gpipe", 2, 2), 2, 2, forward_only=True)


def test_bubble_fraction_of_measured_intervals():
    """Catches a bubble measure that assumes a schedule: unsorted, overlapping, ranks of unequal busy time."""
    busy = [[(2.0, 4.0), (0.0, 2.0)], [(1.0, 3.0), (2.0, 3.0)]]  # rank 0 busy 4 of 4; rank 1 busy 2 of 4
    assert bubble_fraction(busy) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="at least one busy interval"):
        bubble_fraction([[], []])


def test_simulate_with_stage_times_shows_the_cost_of_an_unbalanced_stage():
    """Catches: measured per-stage times ignored by the replay (the bench's ideal bubble for the
    stages it actually ran would then silently be the balanced formula)."""
    schedule = build_schedule("1f1b", 2, 4)
    same = {(kind, stage): t for stage in (0, 1) for kind, t in (("F", 1.0), ("B", 2.0))}
    balanced = simulate(schedule, 2, stage_times=same)
    assert balanced == simulate(schedule, 2)
    slow_last = simulate(schedule, 2, stage_times={**same, ("F", 1): 1.5, ("B", 1): 3.0})
    bubble = bubble_fraction([[(start, end) for _, start, end in lane] for lane in slow_last])
    assert bubble > theoretical_bubble("1f1b", 2, 4) + 0.05


@pytest.mark.parametrize(("name", "pp", "m", "v"), [*_configs(), ("zb_h1", 2, 4, 1), ("zb_h1", 4, 8, 1)])
def test_shared_core_replay_on_dedicated_cores_without_send_times_is_simulate(name, pp, m, v):
    """Catches: the processor-sharing replay breaking a dependency or the order of a rank's actions
    (its last end would then differ from simulate's on every schedule, split and interleaved ones too)."""
    schedule = build_schedule(name, pp, m, v)
    last_end = max(end for lane in simulate(schedule, pp, v, 1.3, 2.1) for _, _, end in lane)
    assert shared_core_makespan(schedule, pp, v, 1.3, 2.1) == pytest.approx(last_end, rel=1e-12)


def test_shared_cores_lend_an_idle_ranks_core_and_sends_delay_only_the_receiver():
    """Catches: a busy rank run at the shared rate while its neighbour idles, a send charged to the
    sender's compute, or a send time put on the wrong boundary. 1F1B, pp 2, 2 micro-batches, t_f 1,
    t_b 2 at half a core each, worked by hand: F0s0 alone (speed 2) ends 0.5; F1s0 and F0s1 share
    (speed 1) to 1.5; B0s1 alone to 2.5; B0s0 and F1s1 to 3.5; B0s0's last unit beside B1s1 to 4.5;
    B1s1 alone to 5; B1s0 alone to 6. With one micro-batch and 0.25 s sends: 0.5 + 0.25 + 0.5 + 1 +
    0.25 + 1 = 3.5; the same send time on the wrap boundary (unused by 1F1B) costs nothing. With 2
    micro-batches and 0.25 s sends, 6.25 (worked the same way; sends that kept their sender busy
    would give 6.75). The interleaved schedule's wrap (rank 3 to rank 0) has a send time of its own.
    Also catches send times beyond the ``pp`` boundaries ignored without a word."""
    two = build_schedule("1f1b", 2, 2)
    assert shared_core_makespan(two, 2, 1, 1.0, 2.0, core_share=0.5) == pytest.approx(6.0)
    assert shared_core_makespan(two, 2, 1, 1.0, 2.0, (0.25,), 0.5) == pytest.approx(6.25)
    one = build_schedule("1f1b", 2, 1)
    assert shared_core_makespan(one, 2, 1, 1.0, 2.0, (0.25,), 0.5) == pytest.approx(3.5)
    assert shared_core_makespan(one, 2, 1, 1.0, 2.0, (0.0, 0.25), 0.5) == pytest.approx(3.0)
    interleaved = build_schedule("interleaved_1f1b", 4, 8, 2)
    free = shared_core_makespan(interleaved, 4, 2, 1.0, 2.0, core_share=0.5)
    assert shared_core_makespan(interleaved, 4, 2, 1.0, 2.0, (0.0, 0.0, 0.0, 0.5), 0.5) > free + 0.1
    with pytest.raises(ValueError, match="core_share"):
        shared_core_makespan(one, 2, 1, core_share=0.0)
    with pytest.raises(ValueError, match="at most one per boundary"):  # a third entry would be dropped silently
        shared_core_makespan(one, 2, 1, 1.0, 2.0, (0.1, 0.1, 0.1), 0.5)
