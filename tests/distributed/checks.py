"""Many named checks in one spawn, each reporting its own result.

Starting processes dominates a distributed test's cost, so a test module spawns once per world
size and runs all its independent checks inside that one spawn. If a check simply raised, the
spawn would fail as a whole: every test reading it would fail, with a traceback that does not
say which check broke, and the checks after it would not run at all. Instead, inside the
spawned function, :func:`run_checks` runs each check, records the traceback of one that raises
and goes on with the next; in the parent, each test fetches its own checks' results with
:func:`check_result`, which fails only that test, naming the check, the rank and the traceback.

Limitation: this isolates checks that fail on every rank, or that fail on some ranks after
their last collective. A check that raises on only some ranks in the middle of a collective
leaves the other ranks waiting in it (or matching it with the next check's collectives), so
those ranks can hang or desynchronise; the spawn's timeout then reports that, failing every
test that reads the spawn. :func:`spawn_once` makes such a spawn fail once, not once per test.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch.distributed as dist

from loomtrain.distributed.spawn import spawn


@dataclass(frozen=True)
class CheckFailed:
    """What :func:`run_checks` records for a check that raised: its name and the traceback of
    every rank on which it raised (the ranks exchange them, so each rank's record has all)."""

    name: str
    tracebacks: dict[int, str]

    def report(self, rank: int) -> str:
        """The failure as read for ``rank``: that rank's traceback if it raised there, else the
        lowest failing rank's; the other failing ranks' last lines."""
        shown = rank if rank in self.tracebacks else min(self.tracebacks)
        ranks = ", ".join(str(r) for r in sorted(self.tracebacks))
        lines = [f"check {self.name!r} raised on rank(s) {ranks}; rank {shown}'s traceback:", self.tracebacks[shown]]
        lines += [f"rank {r}: {tb.strip().splitlines()[-1]}" for r, tb in sorted(self.tracebacks.items()) if r != shown]
        return "\n".join(lines)


def run_checks(checks: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """Call each check in order, inside a spawned function; return name → what it returned, or
    a :class:`CheckFailed` holding its traceback if it raised (an ``Exception``) on any rank.

    A check that raises does not stop the others: the spawn still returns, and only the tests
    that read that check fail (:func:`check_result`). After each check the ranks exchange
    whether it raised (one ``all_gather_object`` over the default group, so every rank must run
    the same checks in the same order), so a check that raised on rank 1 alone is reported
    also by a test that reads only rank 0's results. See the module docstring for the case this
    cannot isolate: a check that raises on some ranks in the middle of a collective.
    """
    distributed = dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    out: dict[str, Any] = {}
    for name, check in checks.items():
        error = None
        try:
            out[name] = check()
        except Exception:
            error = traceback.format_exc()
        errors = [error] * world
        if distributed:
            dist.all_gather_object(errors, error)
        failed = {r: tb for r, tb in enumerate(errors) if tb is not None}
        if failed:
            out[name] = CheckFailed(name, failed)
    return out


def passed(value: Any, rank: int = 0) -> Any:
    """``value`` (one entry of :func:`run_checks`'s result, read for ``rank``) if its check
    passed; else fail the calling test with the check's name, rank(s) and traceback."""
    if isinstance(value, CheckFailed):
        pytest.fail(value.report(rank), pytrace=False)
    return value


def check_result(results: Sequence[Mapping[str, Any]], name: str, rank: int = 0) -> Any:
    """What check ``name`` returned on ``rank``; ``results`` is what :func:`spawn` returned for a
    function that returns :func:`run_checks`'s dict. Fails the calling test (only it), naming
    the check, the rank(s) on which it raised and the traceback, if the check raised."""
    return passed(results[rank][name], rank)


_SPAWNED: dict[tuple, tuple[list[Any] | None, BaseException | None]] = {}


def spawn_once(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float) -> list[Any]:
    """:func:`spawn` ``fn(*args)`` on ``world_size`` processes the first time it is asked for in
    this pytest process, and return the same results afterwards (``args`` must be hashable).

    If the spawn itself fails (a rank crashed, hung past ``timeout_s`` or raised outside
    :func:`run_checks`), that failure is remembered too, and every test asking for it fails
    with it at once: without this, a spawn that hangs would be run again, and its timeout paid,
    by each test sharing it.
    """
    key = (fn.__module__, fn.__qualname__, world_size, args)
    if key not in _SPAWNED:
        try:
            _SPAWNED[key] = (spawn(fn, world_size, *args, timeout_s=timeout_s), None)
        except (RuntimeError, TimeoutError) as e:
            _SPAWNED[key] = (None, e)
    results, error = _SPAWNED[key]
    if error is not None:
        pytest.fail(f"the spawn of {fn.__qualname__} on {world_size} ranks failed:\n{error}", pytrace=False)
    return results
