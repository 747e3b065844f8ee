"""Slow devices on one machine: a rank's process limited to a fraction of one CPU core.

Heterogeneous load balancing (issue #15) needs ranks that really compute slower, not ranks that
sleep: a sleep adds a fixed delay that does not scale with the work, frees the core while the
rank "computes", and leaves the rank's collectives and data loading at full speed. Here the
kernel's CFS bandwidth control (Documentation/scheduler/sched-bwc.rst) gives every thread of
the process together at most ``quota`` microseconds of CPU time per ``period``, so the rank
runs ``speed`` times as fast as on a free core, in everything it does. A speed can be changed
while the rank runs (``CpuThrottle.set_speed``), as a device that heats up or gets a noisy
neighbour would slow down.

Kernel interface: a cgroup of the CPU controller. With cgroup v1 the controller's hierarchy
(``/sys/fs/cgroup/cpu``) holds ``cpu.cfs_period_us`` and ``cpu.cfs_quota_us``; with cgroup v2
one file ``cpu.max`` holds ``"quota period"``. Every group made here lives under one parent
``loomtrain`` at the controller's root and is named ``loomtrain-<tag>@<pid>.<start>``: the
throttled process's pid and its start time (``/proc/<pid>/stat`` field 22, clock ticks after
boot), so ``sweep_stale`` can tell a group whose process has exited even when the pid was
reused. cgroupfs has no room for side files, hence the name.

Why the period is short (``CFS_PERIOD_US`` = 10 ms, not the kernel's default 100 ms): the
process runs at most ``quota`` then waits for the next period, so a 100 ms period makes a
rank at 0.25 run 25 ms and stall 75 ms, a burst pattern that a step of a few milliseconds
would see as random; at 10 ms the stalls are shorter than a step. The kernel's smallest quota
is 1 ms (sched-bwc.rst), so ``MIN_SPEED`` is 0.1.

Why a cap per core (``CORE_CAP``): each rank is pinned to one core and the quotas of the
ranks on a core sum to at most 0.9, so a rank never waits for another rank (it gets its quota
every period) and the kernel, the launcher and rank 0's logging keep 10 % of every core. The
``loomtrain`` parent gets the controller's largest weight (cgroup v1 ``cpu.shares``, v2
``cpu.weight``), so other busy processes on the machine cannot take a rank's quota either;
the quotas, not the weight, bound what the ranks take.
"""

from __future__ import annotations

import atexit
import errno
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from loomtrain.config import ConfigError

CFS_PERIOD_US = 10_000
CORE_CAP = 0.9
MIN_QUOTA_US = 1_000  # sched-bwc.rst: "The minimum quota allowed for the quota or period is 1ms"
MIN_SPEED = MIN_QUOTA_US / CFS_PERIOD_US
PARENT = "loomtrain"
_V1_MAX_SHARES = 262_144  # cpu.shares upper bound (kernel MAX_SHARES, 1 << 18)
_V2_MAX_WEIGHT = 10_000  # cpu.weight range is [1, 10000] (Documentation/admin-guide/cgroup-v2.rst)
_EPS = 1e-9  # float slack when summing speeds: 0.72 + 0.18 must fit a 0.9 core
_TAG = re.compile(r"[A-Za-z0-9._-]{1,200}")
_GROUP = re.compile(r"loomtrain-(?P<tag>[A-Za-z0-9._-]+)@(?P<pid>\d+)\.(?P<start>\d+)")
_ROOT_REASON = "simulate.rank_speed needs root (cgroup CPU controller); run as root or leave simulate.rank_speed empty"


@dataclass(frozen=True)
class SpeedChange:
    """A rank's throttle changed before a step (``simulate.speed_change`` entry ``"step:rank:speed"``).

    Attributes:
        step: the training step (1-based) before which the change applies.
        rank: the global rank whose speed changes.
        speed: the new fraction of one core, ``MIN_SPEED`` to ``CORE_CAP``.
    """

    step: int
    rank: int
    speed: float


@dataclass(frozen=True)
class _Controller:
    """A mounted cgroup CPU controller: the hierarchy's root directory and its cgroup version."""

    root: Path
    version: int

    @property
    def parent(self) -> Path:
        return self.root / PARENT


def _speed_problem(speed: float, upper: float) -> str | None:
    """What is wrong with ``speed`` as a fraction of a core, or ``None`` if it is in
    ``[MIN_SPEED, upper]``."""
    if MIN_SPEED <= speed <= upper + _EPS:
        return None
    if math.isnan(speed):
        return f"is not a number; give a fraction of a core, {MIN_SPEED:g} to {upper:g}"
    if speed > upper:
        return f"is more than {upper:g} of a core, the most one rank may get; lower it"
    return (
        f"is below {MIN_SPEED:g} of a core, the smallest CFS quota ({MIN_QUOTA_US} us per {CFS_PERIOD_US} us "
        f"period, Documentation/scheduler/sched-bwc.rst); use at least {MIN_SPEED:g}"
    )


def _check_speed(speed: float, field: str, upper: float) -> None:
    """Raises ConfigError naming ``field`` unless ``MIN_SPEED <= speed <= upper``."""
    problem = _speed_problem(speed, upper)
    if problem is not None:
        raise ConfigError(f"{field}={speed:g} {problem}")


def plan_cores(speeds: list[float], n_cores: int, cap: float = CORE_CAP) -> list[int]:
    """The core (0 .. ``n_cores``-1) of each rank, so that the speeds on every core sum to <= ``cap``.

    ``speeds[rank]`` is a fraction of one core. Ranks are placed largest speed first (ties in
    rank order, so the plan is deterministic) by worst-fit decreasing: each on the core with the
    most capacity left (lowest index on ties), which spreads the ranks over the cores, e.g.
    ``[0.72, 0.54, 0.36, 0.18]`` on 2 cores → ``[0, 1, 1, 0]``. Worst fit can fail on inputs
    that first-fit decreasing packs (e.g. ``[0.5, 0.5, 0.4, 0.3, 0.3]`` on 2 cores of 1.0), so
    that is tried next. Both heuristics: D. S. Johnson, "Fast algorithms for bin packing",
    J. Comput. Syst. Sci. 8 (1974).

    Raises:
        ConfigError (a ValueError): a speed outside ``[MIN_SPEED, cap]``, ``n_cores`` < 1, or
            speeds that do not fit; the message names ``simulate.rank_speed`` and the fix.
    """
    if n_cores < 1:
        raise ConfigError(f"simulate.rank_speed needs at least one core to throttle on, got n_cores={n_cores}")
    for rank, speed in enumerate(speeds):
        _check_speed(speed, f"simulate.rank_speed[{rank}]", cap)
    total, capacity = sum(speeds), n_cores * cap
    if total > capacity + _EPS:
        raise ConfigError(
            f"simulate.rank_speed sums to {total:g} of a core, more than the {capacity:g} that {n_cores} cores "
            f"hold ({cap:g} each; the rest is left to the kernel and the launcher); lower the speeds or run "
            "fewer ranks on this machine"
        )
    order = sorted(range(len(speeds)), key=lambda rank: (-speeds[rank], rank))
    plan = _fit(speeds, order, n_cores, cap, spread=True) or _fit(speeds, order, n_cores, cap, spread=False)
    if plan is None:
        raise ConfigError(
            f"simulate.rank_speed sums to {total:g}, within the {capacity:g} that {n_cores} cores hold, but no split "
            f"into {n_cores} cores of {cap:g} was found; lower the largest speeds"
        )
    return plan


def _fit(speeds: list[float], order: list[int], n_cores: int, cap: float, spread: bool) -> list[int] | None:
    """Places ranks in ``order``: on the least loaded core (``spread``) or the first core with
    room; ``None`` if one does not fit."""
    load = [0.0] * n_cores
    plan = [0] * len(speeds)
    for rank in order:
        cores = sorted(range(n_cores), key=lambda c: (load[c], c)) if spread else range(n_cores)
        core = next((c for c in cores if load[c] + speeds[rank] <= cap + _EPS), None)
        if core is None:
            return None
        load[core] += speeds[rank]
        plan[rank] = core
    return plan


def place_ranks(speeds: list[float]) -> list[int]:
    """The CPU id (from this process's affinity set) each rank is pinned to: ``plan_cores`` over
    the CPUs this process may run on.

    Raises:
        ConfigError: as ``plan_cores``.
    """
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[core] for core in plan_cores(speeds, len(cpus))]


def parse_speed_changes(entries: list[str]) -> list[SpeedChange]:
    """``simulate.speed_change`` entries ``"step:rank:speed"`` (e.g. ``"200:1:0.25"``: before
    step 200, rank 1 runs at 0.25 of a core), in the order given.

    Raises:
        ConfigError (a ValueError): an entry that is not three fields, a step or rank that is
            not an integer, a step < 1, a rank < 0, or a speed outside ``[MIN_SPEED, CORE_CAP]``;
            the message names ``simulate.speed_change[i]`` and the expected format.
    """
    return [_parse_change(i, entry) for i, entry in enumerate(entries)]


def _parse_change(i: int, entry: str) -> SpeedChange:
    def bad(problem: str) -> ConfigError:
        return ConfigError(
            f'simulate.speed_change[{i}]={entry!r} {problem}; write "step:rank:speed", e.g. "200:1:0.25"'
        )

    parts = entry.split(":")
    if len(parts) != 3:
        raise bad(f"has {len(parts)} fields, not 3")
    try:
        step, rank, speed = int(parts[0]), int(parts[1]), float(parts[2])
    except ValueError:
        raise bad("does not parse: step and rank are integers, speed a fraction of a core") from None
    if step < 1:
        raise bad(f"has step {step}: steps count from 1")
    if rank < 0:
        raise bad(f"has rank {rank}: ranks count from 0")
    problem = _speed_problem(speed, CORE_CAP)
    if problem is not None:
        raise bad(f"has a speed that {problem}")
    return SpeedChange(step, rank, speed)


def _find_controller() -> _Controller | None:
    """The cgroup v1 hierarchy that has the ``cpu`` controller, else a cgroup2 mount whose
    ``cgroup.controllers`` lists ``cpu`` (proc(5) ``/proc/self/mounts``)."""
    mounts = [line.split()[1:4] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for where, fstype, options in mounts:
        if fstype == "cgroup" and "cpu" in options.split(","):
            return _Controller(Path(where), 1)
    for where, fstype, _ in mounts:
        controllers = Path(where) / "cgroup.controllers"
        if fstype == "cgroup2" and controllers.is_file() and "cpu" in controllers.read_text().split():
            return _Controller(Path(where), 2)
    return None


def throttle_requirements() -> str | None:
    """``None`` when ``CpuThrottle`` can work here, else one sentence saying why not (not root,
    no cgroup CPU controller mounted, or its hierarchy read-only, as in most containers)."""
    if os.geteuid() != 0:
        return _ROOT_REASON
    ctrl = _find_controller()
    if ctrl is None:
        return (
            "simulate.rank_speed needs the cgroup CPU controller, but there is none: no cgroup v1 cpu hierarchy "
            "(/sys/fs/cgroup/cpu) and no cgroup2 root whose cgroup.controllers lists cpu; mount one or leave "
            "simulate.rank_speed empty"
        )
    if not os.access(ctrl.root, os.W_OK):
        return (
            f"simulate.rank_speed needs to make cgroups under {ctrl.root}, which is read-only here (a container?); "
            "give the process write access to it or leave simulate.rank_speed empty"
        )
    return None


def _require_controller() -> _Controller:
    reason = throttle_requirements()
    if reason is not None:
        raise ConfigError(reason)
    ctrl = _find_controller()
    assert ctrl is not None  # throttle_requirements found it
    return ctrl


def _proc_start(pid: int) -> int | None:
    """The process's start time (``/proc/<pid>/stat`` field 22, clock ticks after boot), or
    ``None`` if it has exited (gone, zombie or dead; proc(5))."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    return None if fields[0] in ("Z", "X", "x") else int(fields[19])


def _alive(pid: int, start: int) -> bool:
    return _proc_start(pid) == start


def _procs(group: Path) -> list[int]:
    """The pids in ``group`` (its ``cgroup.procs``); none if the group is gone, also when another
    rank's sweep removes it between the open and the read (the kernel answers ENODEV then: four
    ranks starting at once hit it, 2026-12-05)."""
    try:
        return [int(line) for line in (group / "cgroup.procs").read_text().split()]
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENODEV):
            return []
        raise


def _rmdir(path: Path) -> bool:
    """Removes a cgroup; ``False`` if it is gone, still has processes or child groups."""
    try:
        path.rmdir()
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EBUSY, errno.ENOTEMPTY):
            return False
        raise
    return True


def sweep_stale() -> list[str]:
    """Removes every group under the ``loomtrain`` parent that has no process and whose
    throttled process has exited (or whose pid now belongs to another process), then the parent
    if it is empty. A process killed while throttled leaves its group behind; this is how it goes.

    Returns:
        The paths removed (the parent last); empty where throttling is unavailable.
    """
    if throttle_requirements() is not None:
        return []
    parent = _require_controller().parent
    try:
        groups = sorted(p for p in parent.iterdir() if p.is_dir())
    except FileNotFoundError:  # no parent, or another rank's sweep removed it just now
        return []
    removed = []
    for group in groups:
        m = _GROUP.fullmatch(group.name)
        if m is None or _procs(group) or _alive(int(m["pid"]), int(m["start"])):
            continue  # not ours, or still in use (a group being set up is empty, but its process lives)
        if _rmdir(group):
            removed.append(str(group))
    if _rmdir(parent):
        removed.append(str(parent))
    return removed


def _make_parent(ctrl: _Controller) -> None:
    """The ``loomtrain`` parent with the largest weight; on cgroup v2 with ``cpu`` delegated to
    its children (``cgroup.subtree_control``), at the root too."""
    if ctrl.version == 2 and "cpu" not in (ctrl.root / "cgroup.subtree_control").read_text().split():
        (ctrl.root / "cgroup.subtree_control").write_text("+cpu")
    ctrl.parent.mkdir(exist_ok=True)
    if ctrl.version == 1:
        (ctrl.parent / "cpu.shares").write_text(str(_V1_MAX_SHARES))
    else:
        (ctrl.parent / "cpu.weight").write_text(str(_V2_MAX_WEIGHT))
        if "cpu" not in (ctrl.parent / "cgroup.subtree_control").read_text().split():
            (ctrl.parent / "cgroup.subtree_control").write_text("+cpu")


def _make_group(ctrl: _Controller, name: str) -> Path:
    """Makes ``loomtrain/<name>``; retried if another process's sweep removed the empty parent
    after our ``mkdir`` of it, before the group was made in it (a write into the removed
    parent's files then fails with ENODEV, a ``mkdir`` in it with ENOENT)."""
    group = ctrl.parent / name
    for _ in range(5):
        try:
            _make_parent(ctrl)
            group.mkdir()
            return group
        except FileNotFoundError:
            continue
        except FileExistsError:
            raise ConfigError(
                f"{group} exists: this process is already throttled with this tag; close it first"
            ) from None
        except OSError as err:  # after FileExistsError, which is an OSError too
            if err.errno != errno.ENODEV:
                raise
    raise OSError(errno.ENOENT, f"cannot make {group}: its parent keeps disappearing")


def _home_cgroup(ctrl: _Controller, pid: int) -> Path:
    """The CPU-controller cgroup ``pid`` is in now (``/proc/<pid>/cgroup``, cgroups(7)), or the
    controller's root if that path is not visible under the mount."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (ctrl.version == 1 and "cpu" in controllers.split(",")) or (ctrl.version == 2 and controllers == ""):
            home = ctrl.root / path.lstrip("/")
            if home.is_dir():
                return home
    return ctrl.root


def _set_threads_affinity(pid: int, cpus: set[int]) -> None:
    """``sched_setaffinity(2)`` on every thread of ``pid`` (``/proc/<pid>/task``); listed again
    until no new thread shows up, since a thread made by a not yet pinned thread is unpinned."""
    done: set[str] = set()
    while True:
        try:
            tids = set(os.listdir(f"/proc/{pid}/task")) - done
        except FileNotFoundError:
            return
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:
                pass  # the thread exited meanwhile
        done |= tids


class CpuThrottle:
    """One process (all its threads, and children it forks later) limited to ``speed`` of one
    core and pinned to ``core``, by a cgroup of the CPU controller (see the module docstring).

    ``CpuThrottle(pid, speed, core, tag)`` first removes stale groups (``sweep_stale``), then
    makes ``loomtrain/loomtrain-<tag>@<pid>.<start>``, sets its period to ``CFS_PERIOD_US`` and
    its quota to ``round(speed * CFS_PERIOD_US)`` us, moves the process into it (writing the pid
    to ``cgroup.procs`` moves every thread) and pins every thread to ``core``; threads made later
    inherit their creator's affinity (sched_setaffinity(2)). When ``pid`` is this process (a rank
    throttling itself) ``close`` also runs at exit. Usable as a context manager.

    Attributes:
        pid: the throttled process.
        core: the CPU number it is pinned to (as in sched_setaffinity(2)).
        speed: its current fraction of one core.
        path: the cgroup's directory.

    Raises:
        ConfigError (a ValueError): throttling unavailable (``throttle_requirements``), ``speed``
            outside ``[MIN_SPEED, 1]``, a ``core`` the process may not run on, a ``tag`` that is
            not 1-200 of ``[A-Za-z0-9._-]``, or the tag already used for this process.
        ProcessLookupError: ``pid`` is not running.
    """

    def __init__(self, pid: int, speed: float, core: int, tag: str) -> None:
        _check_speed(speed, "speed", 1.0)
        if not _TAG.fullmatch(tag):
            raise ConfigError(f"tag={tag!r} must be 1 to 200 of letters, digits and '._-' (it names a cgroup)")
        self._ctrl = _require_controller()
        sweep_stale()
        start = _proc_start(pid)
        if start is None:
            raise ProcessLookupError(f"cannot throttle pid {pid}: it is not running")
        self._affinity = os.sched_getaffinity(pid)
        if core not in self._affinity:
            raise ConfigError(f"core={core} is not among the CPUs pid {pid} may run on ({sorted(self._affinity)})")
        self.pid, self.core, self.speed, self._start = pid, core, speed, start
        self._home = _home_cgroup(self._ctrl, pid)
        self.path = _make_group(self._ctrl, f"loomtrain-{tag}@{pid}.{start}")
        self._closed = False
        try:
            self._write_quota(speed)
            (self.path / "cgroup.procs").write_text(str(pid))
            _set_threads_affinity(pid, {core})
        except BaseException:
            self.close()
            raise
        self._owner = os.getpid()
        if pid == self._owner:
            atexit.register(self._close_at_exit)

    def _write_quota(self, speed: float) -> None:
        quota = round(speed * CFS_PERIOD_US)
        if self._ctrl.version == 1:
            (self.path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")

    def set_speed(self, speed: float) -> None:
        """Changes the quota while the process runs (from the next period on).

        Raises:
            ConfigError: ``speed`` outside ``[MIN_SPEED, 1]``.
            RuntimeError: after ``close``.
        """
        _check_speed(speed, "speed", 1.0)
        if self._closed:
            raise RuntimeError(f"{self.path.name} is closed; make a new CpuThrottle")
        self._write_quota(speed)
        self.speed = speed

    def close(self) -> None:
        """Moves every process in the group back to the cgroup ``pid`` came from (the controller's
        root if that is gone), restores the process's CPU affinity, and removes the group and the
        ``loomtrain`` parent if empty. Idempotent; safe after the process died or the group was
        swept."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        home = self._home if self._home.is_dir() else self._ctrl.root
        for pid in _procs(self.path):  # children forked while throttled are in the group too
            try:
                (home / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass  # exited meanwhile
        if _alive(self.pid, self._start):  # never touch another process that got the pid
            _set_threads_affinity(self.pid, self._affinity)
        _rmdir(self.path)
        _rmdir(self._ctrl.parent)

    def _close_at_exit(self) -> None:
        if os.getpid() == self._owner:  # a forked child inherits the hook but not the throttle
            self.close()

    def __enter__(self) -> CpuThrottle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
