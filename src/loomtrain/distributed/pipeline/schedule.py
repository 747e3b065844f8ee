"""Pipeline schedules as data: which forward and backward each pipeline rank runs, in which order.

Model of execution (the contract with the executor):

- ``pp`` pipeline ranks hold ``v`` virtual stages (model chunks) each, ``S = pp * v`` stages in all.
  Placement loops over the ranks: stage ``s`` lives on rank ``s % pp``, so rank ``r`` holds stages
  ``r, r + pp, r + 2 pp, ...`` (its chunk ``c`` is stage ``c * pp + r``).
- A step runs ``m`` micro-batches. Each rank runs its list of :class:`Action` strictly in order.
- ``F`` on stage ``s > 0`` first receives the activation of ``(s - 1, mb)`` from rank ``(s - 1) % pp``
  (blocking), computes, then sends its output to rank ``(s + 1) % pp`` if ``s < S - 1`` (non-blocking).
  ``B`` on stage ``s < S - 1`` first receives the output gradient from rank ``(s + 1) % pp``
  (blocking), computes, then sends the input gradient to rank ``(s - 1) % pp`` if ``s > 0``
  (non-blocking). The last stage's ``B`` needs only its own ``F`` (the loss is local). Sender and
  receiver on the same rank (only when ``pp == 1``) hand off locally, without a message.
- Messages travel on channels ``(src_rank, dst_rank, kind)``, kind ``activation`` or ``gradient``.
  NCCL point-to-point has no tags, so a channel pairs sends with receives in FIFO order: on every
  channel the sequence of ``(stage, micro_batch)`` sent must equal the sequence received.

Schedules:

- ``gpipe``: Huang et al., "GPipe" (2019): all forwards, then all backwards.
- ``1f1b``: PipeDream-Flush (Narayanan et al., "PipeDream", 2019; Narayanan et al., "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, §2.2.1): a
  warm-up of forwards, then one forward, one backward, then the remaining backwards. At most ``pp``
  micro-batches are in flight on a rank instead of GPipe's ``m``.
- ``interleaved_1f1b``: Narayanan et al. SC 2021 §2.2.2: 1F1B over ``v`` chunks per rank, which
  divides the pipeline bubble by ``v`` at the price of ``v`` times more messages.
- ``zb_h1``: ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, §2.1, Fig. 3 top).
  The backward splits into ``B`` (gradient of the stage input only, sent upstream at once) and ``W``
  (gradients of the stage's parameters, an action ``W`` of its own that needs only its ``B`` on the
  same rank and sends nothing). 1F1B's order of ``F`` and ``B``, with rank ``r``'s ``W`` deferred by
  ``r`` micro-batches into the cooldown, where 1F1B idles. Counting a micro-batch in flight from its
  ``F`` to its ``W``, every rank holds at most ``pp``: 1F1B's peak (its first rank's).

:func:`check_schedule` proves a schedule complete, causal, deadlock-free and FIFO-consistent before
anything runs; :func:`simulate` replays it with fixed compute times and zero communication time,
:func:`shared_core_makespan` with send times and ranks that share cores.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")

# The schedules whose backward is split into B (input gradient) and W (weight gradient) actions.
SPLIT_BACKWARD = ("zb_h1",)

# How many actions an error message lists before it says "...".
_SHOWN = 6


class ScheduleError(ValueError):
    """A pipeline schedule that cannot run: a bad configuration, or an action list that is incomplete,
    computes a backward before its forward, deadlocks, or pairs the wrong messages on a channel."""


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: ``kind`` ``"F"`` (forward), ``"B"`` (backward: the whole backward, or
    in :data:`SPLIT_BACKWARD` schedules the input gradient only) or ``"W"`` (the weight gradient of a
    split backward) of micro-batch ``micro_batch`` on stage ``stage``."""

    kind: str
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        """``"F3s1"``: forward of micro-batch 3 on stage 1."""
        return f"{self.kind}{self.micro_batch}s{self.stage}"


def stage_rank(stage: int, pp: int) -> int:
    """The pipeline rank that holds ``stage`` under the looping placement (Megatron SC 2021 §2.2.2)."""
    return stage % pp


def rank_stages(rank: int, pp: int, v: int = 1) -> list[int]:
    """The stages on pipeline ``rank``, chunk order: chunk ``c`` is stage ``c * pp + rank``."""
    return [chunk * pp + rank for chunk in range(v)]


def build_schedule(name: str, pp: int, n_micro: int, v: int = 1) -> list[list[Action]]:
    """The action list of every pipeline rank for schedule ``name`` (one of :data:`SCHEDULES`).

    Args:
        name: ``gpipe`` (Huang et al. 2019), ``1f1b`` (PipeDream-Flush; Narayanan et al. 2019, SC 2021
            §2.2.1), ``interleaved_1f1b`` (Narayanan et al. SC 2021 §2.2.2) or ``zb_h1`` (Qi et al.
            ICLR 2024 §2.1).
        pp: pipeline ranks. n_micro: micro-batches per step. v: virtual stages (chunks) per rank.

    Returns:
        ``pp`` lists of actions, rank ``r``'s list at index ``r``, already passed by :func:`check_schedule`.

    Raises:
        ScheduleError: unknown name; ``pp`` or ``n_micro`` below 1; ``v != 1`` without the
            interleaved schedule; the interleaved schedule with ``v < 2`` or ``n_micro`` not a
            multiple of ``pp``; ``zb_h1`` with ``n_micro < pp``. The message names the config field to change.
    """
    _validate(name, pp, n_micro, v)
    build = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved_1f1b": _interleaved, "zb_h1": _zb_h1}[name]
    schedule = [build(rank, pp, n_micro, v) for rank in range(pp)]
    check_schedule(schedule, pp, n_micro, v)
    return schedule


def forward_only_schedule(pp: int, n_micro: int, v: int = 1) -> list[list[Action]]:
    """Forwards only, for evaluation: each rank runs its ``F`` sorted by ``(micro_batch, chunk)``.

    Every ``F`` waits only on an ``F`` earlier in that order (a smaller micro-batch, or the same one
    on an earlier stage), so the schedule cannot deadlock for any ``n_micro``, ``n_micro < pp`` included.

    Raises:
        ScheduleError: ``pp``, ``n_micro`` or ``v`` below 1.
    """
    _validate_sizes(pp, n_micro, v)
    schedule = [
        [Action("F", stage, mb) for mb in range(n_micro) for stage in rank_stages(rank, pp, v)] for rank in range(pp)
    ]
    check_schedule(schedule, pp, n_micro, v, forward_only=True)
    return schedule


def check_schedule(schedule: list[list[Action]], pp: int, n_micro: int, v: int = 1, forward_only: bool = False) -> None:
    """Prove that ``schedule`` runs under the model of execution in the module docstring.

    Args:
        schedule: ``pp`` action lists, one per rank. forward_only: expect only ``F`` actions. A
            schedule holding any ``W`` is a split backward: it must hold every ``W``.

    Raises:
        ScheduleError: a rank holds an action of a stage it does not own; an action is missing,
            duplicated or unexpected; a ``B`` precedes its ``F`` or a ``W`` its ``B`` on its rank; a
            channel's send order differs from its receive order; or the blocking-receive replay
            deadlocks (the message says which rank waits at which action for what).
    """
    if len(schedule) != pp:
        raise ScheduleError(f"the schedule has {len(schedule)} rank lists for parallel.pipeline_parallel_degree={pp}")
    _check_placement(schedule, pp, v)
    kinds = ("F",) if forward_only else ("F", "B", "W") if is_split(schedule) else ("F", "B")
    _check_complete(schedule, pp, n_micro, v, kinds)
    _check_forward_before_backward(schedule)
    _check_channels(schedule, pp, v)
    simulate(schedule, pp, v)


def simulate(
    schedule: list[list[Action]],
    pp: int,
    v: int = 1,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    stage_times: dict[tuple[str, int], float] | None = None,
    weight_time: float | None = None,
) -> list[list[tuple[Action, float, float]]]:
    """Replay ``schedule`` event by event: blocking receives, non-blocking sends, zero communication time.

    A rank's ``v`` chunks together are one model part, so every chunk's ``F`` takes ``forward_time / v``
    and its ``B`` ``backward_time / v`` (any time unit), unless ``stage_times`` gives the duration of
    ``(kind, stage)`` (e.g. measured means, for the ideal bubble of unequal stages). ``backward_time``
    is the whole backward; in a split schedule (holding ``W`` actions) ``W`` takes ``weight_time / v``
    (default: half the backward) and ``B`` the rest. An action starts once its rank is free and its
    inputs are done: ``F(s - 1, mb)`` for ``F(s, mb)``; ``F(s, mb)`` and, below the last stage,
    ``B(s + 1, mb)`` for ``B(s, mb)``; ``B(s, mb)`` for ``W(s, mb)``.

    Returns:
        Per rank, ``(action, start, end)`` in execution order.

    Raises:
        ScheduleError: the schedule deadlocks (which rank waits at which action for what).
    """
    n_stages = pp * v
    duration = {**_durations(schedule, pp, v, forward_time, backward_time, weight_time), **(stage_times or {})}
    no_sends = (0.0,) * pp
    finished: dict[Action, float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in schedule]
    progress = True
    while progress:
        # A list, not a generator: every rank gets its turn in each sweep.
        progress = any(
            [
                _run_ready(*lane, finished, duration, pp, n_stages, no_sends)
                for lane in zip(schedule, timeline, strict=True)
            ]
        )
    _check_progress(schedule, [len(lane) for lane in timeline], finished, pp, n_stages)
    return timeline


def shared_core_makespan(
    schedule: list[list[Action]],
    pp: int,
    v: int = 1,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    send_times: tuple[float, ...] = (),
    core_share: float = 1.0,
    weight_time: float | None = None,
) -> float:
    """The time ``schedule`` takes when its messages take time and its ranks share cores: a
    processor-sharing replay (Kleinrock 1967; Linux's CFS splits the cores among its runnable threads
    this way).

    The ranks run in :func:`simulate`'s order and dependencies, with its ``forward_time``,
    ``backward_time`` and ``weight_time`` per rank, but measured while every rank computes, each at
    ``core_share`` of a core (``world`` ranks on ``core_share · world`` cores; every replica of the
    pipeline runs the same schedule at once). While only ``busy`` of the ``pp`` ranks compute, each
    runs ``min(1 / core_share, pp / busy)`` times faster: an idle rank's core serves the others. A
    message across boundary ``r`` (between ranks ``r`` and ``(r + 1) % pp``, either direction; the
    last boundary is the interleaved schedule's wrap) reaches its receiver ``send_times[r]`` seconds
    after its producer ends (missing entries: 0). Sends are non-blocking and take no compute: the
    receiver waits for the arrival only, and messages on one boundary may be in flight together (no
    link queue). At ``core_share`` 1 and no send times this is :func:`simulate`'s last end.

    Returns:
        Seconds from the first action's start to the last action's end.

    Raises:
        ValueError: ``core_share`` outside ``(0, 1]``, a negative send time, or more send times than
            the ``pp`` boundaries.
        ScheduleError: the schedule deadlocks (which rank waits at which action for what).
    """
    if not 0 < core_share <= 1 or min(send_times, default=0.0) < 0:
        raise ValueError(f"core_share={core_share} must be in (0, 1] and send_times={send_times} non-negative")
    if len(send_times) > pp:
        raise ValueError(f"send_times has {len(send_times)} entries for pp={pp} boundaries: pass at most one per "
                         "boundary (the last is the interleaved schedule's wrap)")  # fmt: skip
    n_stages = pp * v
    duration = _durations(schedule, pp, v, forward_time, backward_time, weight_time)
    sends = tuple(send_times) + (0.0,) * (pp - len(send_times))
    finished: dict[Action, float] = {}
    position, left, now = [0] * len(schedule), [None] * len(schedule), 0.0
    while any(p < len(actions) for p, actions in zip(position, schedule, strict=True)):
        arrivals = [_arrival(actions[p], finished, pp, n_stages, sends) if p < len(actions) and rest is None else None
                    for actions, p, rest in zip(schedule, position, left, strict=True)]  # fmt: skip
        for rank, arrival in enumerate(arrivals):
            if arrival is not None and arrival <= now:
                action = schedule[rank][position[rank]]
                left[rank] = duration[(action.kind, action.stage)]
        busy = sum(rest is not None for rest in left)
        speed = min(1 / core_share, pp / max(1, busy))
        pending = [a for a in arrivals if a is not None and a > now]
        now = _advance(schedule, position, left, finished, now, pending, speed, pp, n_stages)
    return now


def _arrival(action: Action, finished: dict[Action, float], pp: int, n_stages: int,
             sends: tuple[float, ...]) -> float | None:  # fmt: skip
    """When all of ``action``'s inputs are on its rank (a neighbour's message after its boundary's send
    time); None while one is not produced yet."""
    times = []
    for dep in _inputs(action, n_stages):
        if dep not in finished:
            return None
        remote = stage_rank(dep.stage, pp) != stage_rank(action.stage, pp)
        times.append(finished[dep] + (sends[min(dep.stage, action.stage) % pp] if remote else 0.0))
    return max(times, default=0.0)


def _advance(schedule: list[list[Action]], position: list[int], left: list[float | None],
             finished: dict[Action, float], now: float, arrivals: list[float], speed: float,
             pp: int, n_stages: int) -> float:  # fmt: skip
    """Run the busy ranks at ``speed`` up to the next event (an action's end or a message's arrival);
    the new time."""
    busy = [rank for rank, rest in enumerate(left) if rest is not None]
    if not busy and not arrivals:
        _check_progress(schedule, position, finished, pp, n_stages)
    step = min([left[rank] / speed for rank in busy] + [a - now for a in arrivals])
    for rank in busy:
        if left[rank] / speed <= step * (1 + 1e-9):  # ends at this event (to rounding)
            finished[schedule[rank][position[rank]]] = now + step
            position[rank] += 1
            left[rank] = None
        else:
            left[rank] -= step * speed
    return now + step


def _durations(schedule: list[list[Action]], pp: int, v: int, forward_time: float, backward_time: float,
               weight_time: float | None) -> dict[tuple[str, int], float]:  # fmt: skip
    """Each ``(kind, stage)``'s duration: its kind's time for the whole rank (:func:`_kind_times`)
    over the rank's ``v`` chunks."""
    kinds = _kind_times(schedule, forward_time, backward_time, weight_time)
    return {(kind, stage): base / v for kind, base in kinds for stage in range(pp * v)}


def _check_progress(schedule: list[list[Action]], done: list[int], finished: dict[Action, float], pp: int,
                    n_stages: int) -> None:  # fmt: skip
    """Raise :class:`ScheduleError` naming what each unfinished rank waits for, where any rank has
    actions left (``done[rank]``: how many of its actions ran)."""
    waits = [_waiting(rank, actions[n], finished, pp, n_stages)
             for rank, (actions, n) in enumerate(zip(schedule, done, strict=True)) if n < len(actions)]  # fmt: skip
    if waits:
        raise ScheduleError("the schedule deadlocks: " + "; ".join(waits))


def _kind_times(schedule: list[list[Action]], forward_time: float, backward_time: float,
                weight_time: float | None) -> list[tuple[str, float]]:  # fmt: skip
    """Per action kind, its time for the whole rank (all chunks)."""
    if not is_split(schedule):
        return [("F", forward_time), ("B", backward_time)]
    t_b, t_w = _split_backward_times(backward_time, weight_time)
    return [("F", forward_time), ("B", t_b), ("W", t_w)]


def _split_backward_times(backward_time: float, weight_time: float | None) -> tuple[float, float]:
    """``(T_B, T_W)`` of a whole backward of ``backward_time`` split into input and weight
    gradient: ``T_W = weight_time``, by default half the backward."""
    t_w = backward_time / 2 if weight_time is None else weight_time
    return backward_time - t_w, t_w


def is_split(schedule: list[list[Action]]) -> bool:
    """Whether ``schedule`` splits backwards into ``B`` (input gradient) and ``W`` (weight gradient) actions."""
    return any(action.kind == "W" for actions in schedule for action in actions)


def bubble_fraction(busy: list[list[tuple[float, float]]]) -> float:
    """The mean over ranks of the idle share of the step window.

    Args:
        busy: per rank, ``(start, end)`` intervals of compute (any time unit, any order; overlapping
            intervals of one rank count once). Measured wall-clock intervals are fine.

    Returns:
        With window ``[min start, max end]`` over all ranks: mean over ranks of
        ``(window - busy time of the rank) / window``; 0.0 for an empty window.

    Raises:
        ValueError: no interval on any rank.
    """
    intervals = [interval for rank in busy for interval in rank]
    if not intervals:
        raise ValueError("bubble_fraction needs at least one busy interval")
    window = max(end for _, end in intervals) - min(start for start, _ in intervals)
    if window <= 0:
        return 0.0
    return sum((window - _covered(rank)) / window for rank in busy) / len(busy)


def theoretical_bubble(name: str, pp: int, n_micro: int, v: int = 1, forward_time: float = 1.0,
                       backward_time: float = 2.0, weight_time: float | None = None) -> float:  # fmt: skip
    """The bubble fraction of schedule ``name`` with zero communication time.

    ``gpipe`` and ``1f1b``: ``(p - 1) / (m + p - 1)``: each rank idles ``(p - 1)(t_f + t_b)`` in a step
    of ``(m + p - 1)(t_f + t_b)`` (Huang et al. 2019; Narayanan et al. SC 2021 §2.2.1).
    ``interleaved_1f1b``: ``(p - 1) / (v m + p - 1)``: the idle time shrinks to ``(p - 1)(t_f + t_b) / v``
    (Narayanan et al. SC 2021 §2.2.2, where the bubble is divided by ``v``).
    ``zb_h1``: each rank idles ``I = (p - 1)(T_F + T_B - T_W)`` (Qi et al. ICLR 2024 §2.1, Fig. 3) in a
    step of ``m (T_F + T_B + T_W) + I``, with ``T_F = forward_time``, ``T_W = weight_time`` (default:
    half the backward) and ``T_B = backward_time - T_W``; with equal times, ``(p - 1) / (3 m + p - 1)``.
    The paper derives it for equal times; when ``T_W > min(T_F, T_B)`` a ``W`` cannot fill a whole gap
    and :func:`simulate` replays ``I = (p - 1) max(T_F + T_B - T_W, T_F, T_B)``, the value used then.
    The times matter only to ``zb_h1``.

    Raises:
        ScheduleError: the same configurations :func:`build_schedule` refuses.
    """
    _validate(name, pp, n_micro, v)
    if name not in SPLIT_BACKWARD:
        return (pp - 1) / (v * n_micro + pp - 1)
    t_b, t_w = _split_backward_times(backward_time, weight_time)
    idle = (pp - 1) * max(forward_time + t_b - t_w, forward_time, t_b)
    return idle / (n_micro * (forward_time + backward_time) + idle)


def peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches one rank holds activations for: ``F`` run and its last backward action
    (``B``, or ``W`` in a split schedule, which frees the saved graph) not yet, counted per
    ``(stage, micro_batch)``. 1F1B and ZB-H1 keep it at most ``pp``; GPipe reaches ``m``."""
    release = "W" if is_split([actions]) else "B"
    in_flight: set[tuple[int, int]] = set()
    peak = 0
    for action in actions:
        if action.kind == "F":
            in_flight.add((action.stage, action.micro_batch))
        elif action.kind == release:
            in_flight.discard((action.stage, action.micro_batch))
        peak = max(peak, len(in_flight))
    return peak


def format_schedule(schedule: list[list[Action]]) -> str:
    """One line per rank, e.g. ``rank 0: F0s0 F1s0 B0s0 ...``, columns aligned across ranks."""
    width = max((len(str(action)) for actions in schedule for action in actions), default=0)
    label = len(str(len(schedule) - 1))
    return "\n".join(
        f"rank {rank:>{label}}: " + " ".join(f"{action!s:<{width}}" for action in actions).rstrip()
        for rank, actions in enumerate(schedule)
    )


def _validate_sizes(pp: int, n_micro: int, v: int) -> None:
    if pp < 1:
        raise ScheduleError(f"parallel.pipeline_parallel_degree={pp} must be at least 1")
    if v < 1:
        raise ScheduleError(f"parallel.virtual_stages={v} must be at least 1")
    if n_micro < 1:
        raise ScheduleError(
            f"the micro-batches per step ({n_micro}) must be at least 1; raise training.global_batch_size "
            "or lower training.micro_batch_size"
        )


def _validate(name: str, pp: int, n_micro: int, v: int) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"parallel.pipeline_schedule={name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    _validate_sizes(pp, n_micro, v)
    if name != "interleaved_1f1b" and v != 1:
        raise ScheduleError(
            f"parallel.virtual_stages={v} needs parallel.pipeline_schedule='interleaved_1f1b' (got {name!r})"
        )
    if name == "interleaved_1f1b" and v < 2:
        raise ScheduleError(
            f"parallel.pipeline_schedule='interleaved_1f1b' needs parallel.virtual_stages >= 2 (got {v}); "
            "use '1f1b' for one stage per rank"
        )
    if name == "zb_h1" and n_micro < pp:
        raise ScheduleError(
            f"parallel.pipeline_schedule='zb_h1' needs at least parallel.pipeline_parallel_degree={pp} micro-batches "
            f"per step (got {n_micro}); raise training.global_batch_size or lower training.micro_batch_size"
        )
    if name == "interleaved_1f1b" and n_micro % pp:
        raise ScheduleError(
            f"interleaved_1f1b needs the micro-batches per step ({n_micro}) to be a multiple of "
            f"parallel.pipeline_parallel_degree={pp}; change training.global_batch_size or training.micro_batch_size"
        )


def _gpipe(rank: int, pp: int, n_micro: int, v: int) -> list[Action]:
    return [Action("F", rank, mb) for mb in range(n_micro)] + [Action("B", rank, mb) for mb in range(n_micro)]


def _one_f_one_b(rank: int, pp: int, n_micro: int, v: int) -> list[Action]:
    # Rank r needs pp - r - 1 forwards in flight before the first gradient can come back from the
    # last stage; capping by n_micro keeps n_micro < pp runnable.
    forwards = [Action("F", rank, mb) for mb in range(n_micro)]
    backwards = [Action("B", rank, mb) for mb in range(n_micro)]
    return _warmup_steady_cooldown(forwards, backwards, min(pp - rank - 1, n_micro))


def _zb_h1(rank: int, pp: int, n_micro: int, v: int) -> list[Action]:
    # Qi et al. ICLR 2024 §2.1: 1F1B's F and B order; rank r runs W(k - r) after B(k), so every rank
    # holds pp micro-batches from F to W (rank 0's 1F1B peak), and the r deferred W fill the cooldown.
    warmup = pp - rank - 1
    actions = [Action("F", rank, mb) for mb in range(warmup)]
    for k in range(n_micro):
        if warmup + k < n_micro:
            actions.append(Action("F", rank, warmup + k))
        actions.append(Action("B", rank, k))
        if k >= rank:
            actions.append(Action("W", rank, k - rank))
    return actions + [Action("W", rank, mb) for mb in range(n_micro - rank, n_micro)]


def _interleaved(rank: int, pp: int, n_micro: int, v: int) -> list[Action]:
    # Megatron SC 2021 §2.2.2: forwards go through the chunks in groups of pp micro-batches;
    # backwards walk the chunks in reverse, so the gradient of a group meets its own activations.
    total = n_micro * v
    forwards = [Action("F", _chunk(k, pp, v) * pp + rank, _micro_batch(k, pp, v)) for k in range(total)]
    backwards = [Action("B", (v - 1 - _chunk(k, pp, v)) * pp + rank, _micro_batch(k, pp, v)) for k in range(total)]
    # Megatron's counts, kept so orders match the reference. In this model (non-blocking sends, zero
    # communication time) a warm-up of (pp - r - 1) + (v - 1) * pp, and no special case for
    # n_micro == pp, would give the same bubble with fewer activations in flight.
    warmup = total if n_micro == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    return _warmup_steady_cooldown(forwards, backwards, warmup)


def _chunk(k: int, pp: int, v: int) -> int:
    return (k // pp) % v


def _micro_batch(k: int, pp: int, v: int) -> int:
    return (k // (pp * v)) * pp + k % pp


def _warmup_steady_cooldown(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    actions = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards, strict=False):
        actions += [forward, backward]
    return actions + backwards[len(forwards) - warmup :]


def _run_ready(
    actions: list[Action],
    done: list[tuple[Action, float, float]],
    finished: dict[Action, float],
    duration: dict[tuple[str, int], float],
    pp: int,
    n_stages: int,
    sends: tuple[float, ...],
) -> bool:
    """Run one rank's actions in order until one lacks an input; True if any ran."""
    ran = False
    while len(done) < len(actions):
        action = actions[len(done)]
        arrival = _arrival(action, finished, pp, n_stages, sends)
        if arrival is None:
            break
        start = max(done[-1][2] if done else 0.0, arrival)
        finished[action] = start + duration[(action.kind, action.stage)]
        done.append((action, start, finished[action]))
        ran = True
    return ran


def _inputs(action: Action, n_stages: int) -> list[Action]:
    """The actions whose results ``action`` consumes: its neighbour's message and, for a backward, its
    own forward (for a weight gradient, its own input gradient)."""
    producer = _producer(action, n_stages)
    local = _same_rank_input(action)
    return [dep for dep in (producer, local) if dep is not None]


def _same_rank_input(action: Action) -> Action | None:
    """The action on the same stage that must run before ``action``: ``F`` before ``B``, ``B`` before ``W``."""
    before = {"B": "F", "W": "B"}.get(action.kind)
    return None if before is None else Action(before, action.stage, action.micro_batch)


def _producer(action: Action, n_stages: int) -> Action | None:
    """The action on the neighbouring stage whose result ``action`` receives, if any."""
    if action.kind == "F":
        return Action("F", action.stage - 1, action.micro_batch) if action.stage > 0 else None
    if action.kind == "W":
        return None
    return Action("B", action.stage + 1, action.micro_batch) if action.stage < n_stages - 1 else None


def _channel_kind(action: Action) -> str:
    return "activation" if action.kind == "F" else "gradient"


def _waiting(rank: int, action: Action, finished: dict[Action, float], pp: int, n_stages: int) -> str:
    missing = [dep for dep in _inputs(action, n_stages) if dep not in finished]
    reasons = [
        f"{dep} on its own rank"
        if stage_rank(dep.stage, pp) == rank
        else f"the {_channel_kind(dep)} of {dep} from rank {stage_rank(dep.stage, pp)}"
        for dep in missing
    ]
    return f"rank {rank} waits at {action} for " + " and ".join(reasons)


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _shown(actions: list[Action]) -> str:
    text = " ".join(str(action) for action in actions[:_SHOWN])
    return text + (" ..." if len(actions) > _SHOWN else "")


def _check_placement(schedule: list[list[Action]], pp: int, v: int) -> None:
    for rank, actions in enumerate(schedule):
        owned = rank_stages(rank, pp, v)
        for action in actions:
            if action.kind not in ("F", "B", "W"):
                raise ScheduleError(f"rank {rank} holds {action} of unknown kind {action.kind!r}; use 'F', 'B' or 'W'")
            if action.stage not in owned:
                raise ScheduleError(f"rank {rank} holds {action} but owns only stages {owned}")


def _check_complete(schedule: list[list[Action]], pp: int, n_micro: int, v: int, kinds: tuple[str, ...]) -> None:
    expected = {Action(kind, stage, mb) for kind in kinds for stage in range(pp * v) for mb in range(n_micro)}
    counts = Counter(action for actions in schedule for action in actions)
    problems = {
        "missing": sorted(expected - counts.keys(), key=_order),
        "duplicated": sorted((action for action, n in counts.items() if n > 1), key=_order),
        "unexpected": sorted(counts.keys() - expected, key=_order),
    }
    found = [f"{what}: {_shown(actions)}" for what, actions in problems.items() if actions]
    if found:
        raise ScheduleError(f"the schedule for {n_micro} micro-batches over {pp * v} stages has " + "; ".join(found))


def _order(action: Action) -> tuple[int, int, str]:
    return (action.micro_batch, action.stage, action.kind)


def _check_forward_before_backward(schedule: list[list[Action]]) -> None:
    for rank, actions in enumerate(schedule):
        seen: set[Action] = set()
        for action in actions:
            needed = _same_rank_input(action)
            if needed is not None and needed not in seen:
                raise ScheduleError(f"rank {rank} runs {action} before {needed}")
            seen.add(action)


def _check_channels(schedule: list[list[Action]], pp: int, v: int) -> None:
    """Compare, per channel, the producers in send order with the producers in receive order."""
    n_stages = pp * v
    sent: dict[tuple[int, int, str], list[Action]] = defaultdict(list)
    received: dict[tuple[int, int, str], list[Action]] = defaultdict(list)
    for rank, actions in enumerate(schedule):
        for action in actions:
            producer = _producer(action, n_stages)
            if producer is not None and stage_rank(producer.stage, pp) != rank:
                received[(stage_rank(producer.stage, pp), rank, _channel_kind(action))].append(producer)
            consumer = _consumer(action, n_stages)
            if consumer is not None and stage_rank(consumer.stage, pp) != rank:
                sent[(rank, stage_rank(consumer.stage, pp), _channel_kind(action))].append(action)
    for channel in sorted(sent.keys() | received.keys()):
        sends, receives = sent[channel], received[channel]
        if sends != receives:
            src, dst, kind = channel
            first = _first_difference(sends, receives)
            raise ScheduleError(
                f"channel rank {src} -> rank {dst} ({kind}) pairs messages in FIFO order (NCCL has no tags), but "
                f"from message {first} on rank {src} sends the outputs of {_shown(sends[first:])} while rank {dst} "
                f"expects those of {_shown(receives[first:])}"
            )


def _first_difference(a: list[Action], b: list[Action]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _consumer(action: Action, n_stages: int) -> Action | None:
    """The action on the neighbouring stage that receives the result of ``action``, if any."""
    if action.kind == "F":
        return Action("F", action.stage + 1, action.micro_batch) if action.stage < n_stages - 1 else None
    if action.kind == "W":
        return None
    return Action("B", action.stage - 1, action.micro_batch) if action.stage > 0 else None
