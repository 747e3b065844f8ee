"""Real slow devices (``loomtrain.cluster.throttle``): busy processes throttled by the cgroup
CPU controller, their CPU share measured from ``/proc/<pid>/stat`` (utime + stime, proc(5)).

Every busy child is killed and every throttle closed in fixtures, even when a test fails.
Skipped, with ``throttle_requirements()``'s reason, where throttling cannot work (not root, no
CPU controller, a read-only cgroupfs); the non-root refusal runs everywhere.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loomtrain.cluster.throttle import CpuThrottle, sweep_stale, throttle_requirements
from loomtrain.config import ConfigError

ROOT_REASON = "simulate.rank_speed needs root (cgroup CPU controller); run as root or leave simulate.rank_speed empty"
# Two spinning threads: a throttle that moves or pins only the main thread lets the other run free.
BUSY = textwrap.dedent("""
    import threading
    def spin():
        while True:
            pass
    threading.Thread(target=spin, daemon=True).start()
    print("ready", flush=True)
    spin()
""")
# Throttles itself, forks a child that exits through the interpreter (running atexit hooks),
# prints its group and whether it is still in it, and exits without calling close.
SELF = textwrap.dedent("""
    import os, sys
    from loomtrain.cluster.throttle import CpuThrottle
    t = CpuThrottle(os.getpid(), 0.5, int(sys.argv[1]), sys.argv[2])
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    os.waitpid(pid, 0)
    print(t.path, t.path.name in open("/proc/self/cgroup").read(), flush=True)
""")
SECONDS = 1.5
PREFIX = "lttest"  # our groups' tags; a throttled training run may hold other groups meanwhile


@pytest.fixture
def throttling() -> None:
    reason = throttle_requirements()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def busy(throttling):
    """Starts two-thread busy-loop children; kills and reaps them at teardown."""
    children: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
        children.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p

    yield start
    for p in children:
        p.kill()
        p.wait()
        p.stdout.close()


@pytest.fixture
def throttles(throttling):
    """``make(pid, speed, core)`` → a CpuThrottle with a fresh tag; all closed at teardown."""
    made: list[CpuThrottle] = []

    def make(pid: int, speed: float, core: int) -> CpuThrottle:
        made.append(CpuThrottle(pid, speed, core, tag=f"{PREFIX}{secrets.token_hex(3)}"))
        return made[-1]

    yield make
    for t in made:
        t.close()


def cpu_shares(pids: list[int], seconds: float = SECONDS) -> list[float]:
    """Each process's CPU time over ``seconds`` of wall time, as a fraction of one core."""

    def cpu_s(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    wall0, cpu0 = time.monotonic(), [cpu_s(p) for p in pids]
    time.sleep(seconds)
    wall, cpu = time.monotonic() - wall0, [cpu_s(p) for p in pids]
    shares = [(c - c0) / wall for c, c0 in zip(cpu, cpu0, strict=True)]
    print("measured shares", [round(s, 3) for s in shares])
    return shares


def thread_affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in sorted(os.listdir(f"/proc/{pid}/task"))]


def cpu_cgroup(pid: int, root: Path) -> str:
    """``pid``'s cgroup path in the CPU controller's hierarchy mounted at ``root``."""
    v2 = (root / "cgroup.controllers").exists()
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (v2 and controllers == "") or (not v2 and "cpu" in controllers.split(",")):
            return path
    raise AssertionError(f"no cpu controller line in /proc/{pid}/cgroup")


def our_groups(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.glob(f"loomtrain-{PREFIX}*") if p.is_dir())


def leftovers(root: Path) -> list[str]:
    """What this test left under the controller's ``root``: its groups, and the ``loomtrain``
    parent unless another process's group still needs it."""
    parent = root / "loomtrain"
    if not parent.is_dir():
        return []
    ours, groups = our_groups(parent), [p for p in parent.iterdir() if p.is_dir()]
    return ours + ["loomtrain"] if len(ours) == len(groups) else ours


def test_share_follows_speed_and_close_undoes_it(busy, throttles):
    """Catches: a quota in the wrong unit or period (share far from the speed), only the main
    thread moved or pinned (the second spinning thread runs free), ``set_speed`` not applied
    live, and ``close`` leaving the group, the process in it, or the process pinned."""
    pid = busy().pid
    core = min(os.sched_getaffinity(pid))
    affinity, cgroups = os.sched_getaffinity(pid), Path(f"/proc/{pid}/cgroup").read_text()
    t = throttles(pid, 0.25, core)
    root = t.path.parents[1]
    assert cpu_cgroup(pid, root) == f"/loomtrain/{t.path.name}" and t.path.name.startswith(f"loomtrain-{PREFIX}")
    assert thread_affinities(pid) == [{core}, {core}]
    assert cpu_shares([pid])[0] == pytest.approx(0.25, abs=0.05)
    t.set_speed(0.5)
    assert cpu_shares([pid])[0] == pytest.approx(0.5, abs=0.07)
    t.close()
    t.close()
    assert leftovers(root) == [] and Path(f"/proc/{pid}/cgroup").read_text() == cgroups
    assert thread_affinities(pid) == [affinity, affinity]


def test_ranks_sharing_a_core_each_get_their_share(busy, throttles):
    """Catches: ranks on one core slowing each other (quotas not per process, or pinning that
    missed a thread), and an unthrottled busy process on that core taking a rank's quota (the
    ``loomtrain`` parent without the largest weight); the cap's 10 % must stay free for it."""
    a, b, noisy = busy().pid, busy().pid, busy().pid
    core = min(os.sched_getaffinity(a))
    for tid in os.listdir(f"/proc/{noisy}/task"):
        os.sched_setaffinity(int(tid), {core})
    throttles(a, 0.54, core)
    throttles(b, 0.36, core)
    assert os.sched_getaffinity(a) == os.sched_getaffinity(b) == {core}
    share_a, share_b, share_noisy = cpu_shares([a, b, noisy])
    assert share_a == pytest.approx(0.54, abs=0.05) and share_b == pytest.approx(0.36, abs=0.05)
    assert 0.02 < share_noisy < 0.16


def test_killed_process_group_is_swept(busy, throttles):
    """Catches: a group left behind forever when its process is killed (close never runs), a
    sweep that removes a live rank's group or one still being set up (empty, process alive),
    and ``close`` failing once the group was swept."""
    dead, live = busy(), busy()
    core = min(os.sched_getaffinity(dead.pid))
    t_dead, t_live = throttles(dead.pid, 0.25, core), throttles(live.pid, 0.25, core)
    parent = t_dead.path.parent
    start = Path(f"/proc/{os.getpid()}/stat").read_text().rpartition(")")[2].split()[19]
    setting_up = parent / f"loomtrain-{PREFIX}setup@{os.getpid()}.{start}"
    setting_up.mkdir()
    try:
        dead.kill()
        dead.wait()
        assert sweep_stale() == [str(t_dead.path)]
        assert our_groups(parent) == sorted([t_live.path.name, setting_up.name])
    finally:
        if setting_up.is_dir():
            setting_up.rmdir()
    t_dead.close()
    t_live.close()
    assert leftovers(parent.parent) == []


def test_sweep_survives_a_group_another_rank_removes_while_it_reads(busy, throttles, monkeypatch):
    """Catches: ranks starting at once, each sweeping stale groups, where one rank removes a stale
    group after another has opened its ``cgroup.procs`` and before it reads it: the read fails with
    ENODEV, and the rank died at start (make test, 2026-12-05, the pp 2 × dp 2 balance test). The
    interleaving is made here: the read opens the file, removes the group, then reads."""
    live = busy()
    t_live = throttles(live.pid, 0.5, min(os.sched_getaffinity(live.pid)))
    stale = t_live.path.parent / f"loomtrain-{PREFIX}race@{os.getpid()}.1"  # start time 1: not this process
    stale.mkdir()
    read_text = Path.read_text

    def read_after_removal(path: Path, *args, **kwargs) -> str:
        if path != stale / "cgroup.procs":
            return read_text(path, *args, **kwargs)
        with path.open() as f:
            stale.rmdir()
            return f.read()

    monkeypatch.setattr(Path, "read_text", read_after_removal)
    try:
        assert sweep_stale() == []
    finally:
        monkeypatch.undo()
        if stale.is_dir():
            stale.rmdir()
    assert our_groups(t_live.path.parent) == [t_live.path.name]


def test_self_throttled_rank_cleans_up_at_exit(throttling):
    """Catches: a rank that throttles itself and exits without close leaving its group (no
    atexit hook), and a forked child's exit running that hook, which would un-throttle the rank."""
    core = min(os.sched_getaffinity(0))
    tag = f"{PREFIX}{secrets.token_hex(3)}"
    r = subprocess.run([sys.executable, "-c", SELF, str(core), tag], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    path, still_in = r.stdout.split()
    assert still_in == "True" and f"loomtrain-{tag}@" in path
    assert not Path(path).exists() and leftovers(Path(path).parents[1]) == []


def test_non_root_refused_with_the_fix():
    """Catches: a non-root run failing halfway with EACCES from cgroupfs (a traceback) instead
    of one sentence with the fix, and ``sweep_stale`` raising for a user who cannot throttle.
    As root, the check runs in a forked child that drops to uid/gid 65534 after the import (so
    it does not depend on that user reading the checkout), as tests/integration/test_cluster.py."""
    if os.geteuid() != 0:
        assert throttle_requirements() == ROOT_REASON
        return
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        os._exit(_report_unprivileged(write_fd))
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        lines = f.read().splitlines()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, lines
    assert lines == [ROOT_REASON, ROOT_REASON, "[]"]


def _report_unprivileged(fd: int) -> int:
    """As uid/gid 65534: writes throttle_requirements(), CpuThrottle's error and sweep_stale()'s
    result to ``fd``, one per line; the exit status."""
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        out = [str(throttle_requirements())]
        try:
            CpuThrottle(os.getpid(), 0.5, min(os.sched_getaffinity(0)), "nobody")
            out.append("CpuThrottle did not refuse")
        except ConfigError as e:
            out.append(str(e))
        out.append(str(sweep_stale()))
        os.write(fd, "\n".join(out).encode())
        return 0
    except BaseException as e:
        os.write(fd, repr(e).encode())
        return 1
