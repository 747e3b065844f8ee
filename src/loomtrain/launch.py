"""Starting workers through torchrun: on this machine, plain or elastic with restarts, or one
agent per host of an emulated cluster (``--cluster``), as on real machines.

- Plain (``--nproc N``): one torchrun agent, ``--standalone``, N workers; a failure ends the job.
- Elastic (``--elastic``): c10d rendezvous and ``--max-restarts``. With a fixed size, one agent
  runs N workers and restarts all of them when one dies. With ``--min-nproc A --max-nproc B``,
  each worker gets an agent of its own (a one-process "node"), so losing one shrinks the job to
  the survivors (down to A) and a new one can join (up to B), as whole nodes do across hosts.
  Every attempt resumes from the newest complete checkpoint.

- Emulated cluster (``--cluster NAME``, see ``loomtrain.cluster``): one torchrun agent per host,
  inside its network namespace, ``--nnodes H --node-rank i`` with c10d rendezvous on host 0;
  with ``--elastic --min-nodes A``, losing a host (its processes killed, or its link gone
  silent until the collective timeout) shrinks the job to the remaining hosts, host 0
  excepted: it serves the rendezvous. With ``--distributed.rendezvous=etcd`` every host runs
  an etcd member and any one host may be lost (``loomtrain.cluster.etcd``).

The launcher passes SIGTERM and SIGINT on to the agents, which pass them to the workers; the
workers checkpoint at the current step and stop. The launcher then exits 0 if the event log
shows that preemption checkpoint.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loomtrain.agent_log import TTY_ENV, Pump, Story
from loomtrain.distributed.spawn import free_port
from loomtrain.metrics import EventLog

if TYPE_CHECKING:
    from loomtrain.cluster.emulated import Cluster

# torchrun's etcd-v2 rendezvous retrying through an etcd leader election (cluster/etcd_backend.py).
ETCD_BACKEND = "loomtrain-etcd"
# torchrun's default rendezvous port; each emulated host has its own port space.
RDZV_PORT = 29400
# Seconds the rendezvous waits for more nodes once the minimum has joined.
LAST_CALL_S = 5
# Rendezvous settings for jobs that may shrink (torchrun's dynamic rendezvous, "rdzv-conf"). A
# node that died is dropped from the rendezvous when it missed keep_alive_max_attempt heartbeats
# keep_alive_interval s apart (torch's defaults 5 s × 3 = 15 s), and the survivors wait
# last_call_timeout more (default 30 s) for latecomers: 45 s of a shrink's recovery (issue #23,
# item 8). A heartbeat is a store write from an idle agent thread: 3 s still spans a loaded machine.
SHRINK_CONF = {"last_call_timeout": str(LAST_CALL_S), "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
# Seconds the other agents get to finish after one agent finished the job.
STRAGGLER_GRACE_S = 60
# Seconds to wait for an ended agent's last output (its workers may still hold the pipe).
PUMP_DRAIN_S = 5


@dataclass(frozen=True)
class ElasticSpec:
    """Elastic launch bounds in torchrun nodes (one-process nodes on this machine, hosts of a
    cluster) and how often the agents may restart."""

    min_nodes: int
    max_nodes: int
    max_restarts: int


def torchrun_argv(nnodes: str, nproc_per_node: int, rdzv_endpoint: str, run_id: str, max_restarts: int,
                  rdzv_conf: dict[str, str] | None = None, node_rank: int | None = None,
                  local_addr: str | None = None, backend: str = "c10d") -> list[str]:  # fmt: skip
    """One torchrun agent's command line with ``backend`` rendezvous (``c10d``, or
    ``loomtrain-etcd``: see ``loomtrain.cluster.etcd``) at ``rdzv_endpoint`` (``host:port``), what a user types on
    each machine of a multi-node job (torchrun docs, "Elastic launch").

    ``nnodes`` is ``"N"`` or ``"MIN:MAX"``; ``local_addr`` is the address peers reach this node
    at (torchrun otherwise uses the hostname, which emulated hosts share); the worker command
    (``-m loomtrain.cli ...``) follows.
    """
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            f"--rdzv-backend={backend}", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={run_id}",
            f"--max-restarts={max_restarts}"]  # fmt: skip
    if node_rank is not None:
        argv.append(f"--node-rank={node_rank}")
    if local_addr is not None:
        argv.append(f"--local-addr={local_addr}")
    if rdzv_conf:
        argv.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv_conf.items()))
    return argv


def agent_commands(nproc: int, worker_argv: list[str], elastic: ElasticSpec | None, run_id: str) -> list[list[str]]:
    """One torchrun command line per agent to start on this machine."""
    worker = ["-m", "loomtrain.cli", "train", *worker_argv]
    if elastic is None:
        return [[sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *worker]]
    endpoint = f"127.0.0.1:{free_port()}"
    if elastic.min_nodes == elastic.max_nodes == nproc:
        return [[*torchrun_argv("1", nproc, endpoint, run_id, elastic.max_restarts), *worker]]
    nnodes = f"{elastic.min_nodes}:{elastic.max_nodes}"
    # All agents share this host, so say which one serves the rendezvous store.
    confs = [{"is_host": str(int(i == 0)), **SHRINK_CONF} for i in range(nproc)]
    return [[*torchrun_argv(nnodes, 1, endpoint, run_id, elastic.max_restarts, conf), *worker] for conf in confs]


def _preemption_since(run_dir: Path, since: float) -> dict | None:
    """The ``preempted`` event (step, checkpoint) the workers logged since ``since`` (Unix s), if any."""
    events = EventLog(run_dir, enabled=False).read()
    return next((e for e in reversed(events) if e["event"] == "preempted" and e["time"] >= since), None)


def _agent_env(rendezvous: bool) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if rendezvous:
        # Restarted gloo workers otherwise may reuse the previous attempt's store address and
        # hang (pytorch issue 135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def launch(nproc: int, worker_argv: list[str], elastic: ElasticSpec | None, run_dir: Path, run_id: str) -> int:
    """Run this machine's agents to completion; returns the job's exit status (0: finished or
    preempted with a checkpoint)."""
    return run_agents(agent_commands(nproc, worker_argv, elastic, run_id), _agent_env(elastic is not None), run_dir)


def cluster_commands(cluster: Cluster, worker: list[str], elastic: ElasticSpec | None, run_id: str,
                     port: int = RDZV_PORT, etcd_endpoints: list[str] | None = None) -> list[list[str]]:  # fmt: skip
    """One torchrun agent per emulated host, started inside that host's network namespace, each
    running ``procs_per_host`` copies of ``worker`` (e.g. ``["-m", "loomtrain.cli", "train", ...]``):
    ``--nnodes H`` (elastic: ``MIN:MAX`` hosts), ``--node-rank i``, ``--local-addr`` the host's own
    address. The rendezvous is c10d, served by host 0; with ``etcd_endpoints`` (``ADDRESS:PORT``
    per host, see ``loomtrain.cluster.etcd``) it is ``loomtrain-etcd`` (torchrun's etcd-v2,
    retrying), host ``i`` using ``etcd_endpoints[i]``, so no host is needed by the others."""
    hosts, nproc = cluster.spec.hosts, cluster.spec.procs_per_host
    nnodes = str(hosts) if elastic is None else f"{elastic.min_nodes}:{elastic.max_nodes}"
    restarts = 0 if elastic is None else elastic.max_restarts
    cmds = []
    for i in range(hosts):
        # A host that left needs seconds, not the defaults, before the survivors go on without it.
        conf = dict(SHRINK_CONF)
        if etcd_endpoints is None:
            # Host 0's address is local to its namespace only; say who serves the store rather
            # than rely on torchrun matching it against the (shared) hostname.
            conf["is_host"] = str(int(i == 0))
            endpoint = f"{cluster.address(0)}:{port}"
        else:
            endpoint = etcd_endpoints[i]
        backend = "c10d" if etcd_endpoints is None else ETCD_BACKEND
        agent = torchrun_argv(nnodes, nproc, endpoint, run_id, restarts, conf, i, cluster.address(i), backend)
        cmds.append(cluster.exec_argv(i, [*agent, *worker]))
    return cmds


def launch_cluster(cluster: Cluster, worker: list[str], elastic: ElasticSpec | None, run_dir: Path | None,
                   run_id: str, rendezvous: str = "c10d") -> int:  # fmt: skip
    """Run one torchrun agent per emulated host to completion (see :func:`cluster_commands`).

    ``rendezvous="etcd"`` first starts one etcd member per host (``loomtrain.cluster.etcd``) and
    stops it, deleting its data, when the agents are done.

    Raises:
        ClusterError: ``rendezvous`` is neither ``c10d`` nor ``etcd``; for ``etcd``, etcd or
            python-etcd missing, fewer than 3 hosts, or members that do not become healthy.
    """
    from loomtrain.cluster.emulated import ClusterError
    from loomtrain.cluster.etcd import etcd_members

    env = _agent_env(True)
    if rendezvous == "c10d":
        return run_agents(cluster_commands(cluster, worker, elastic, run_id), env, run_dir)
    if rendezvous != "etcd":
        raise ClusterError(f"--distributed.rendezvous={rendezvous!r} is not known; use c10d or etcd")
    with etcd_members(cluster, token=f"{run_id}-{os.getpid()}") as members:
        endpoints = [m.endpoint for m in members]
        return run_agents(cluster_commands(cluster, worker, elastic, run_id, etcd_endpoints=endpoints), env, run_dir)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, even by SIGKILL (prctl(2),
    ``PR_SET_PDEATHSIG``; kept across exec). Chained launcher → torchrun agent → workers, so a
    killed ``loomtrain train`` leaves no process of its job behind (issue #23, item 2). Exits
    at once if the parent is already gone (re-parented to init). No-op off Linux."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)


def run_agents(cmds: list[list[str]], env: dict[str, str], run_dir: Path | None) -> int:
    """Start the agents, forward SIGTERM/SIGINT to them, and wait.

    Returns 0 when an agent finished the job (with one agent per node, the agent of a lost
    node exits non-zero while the survivors finish) or a stop request ended in a preemption
    checkpoint in ``run_dir``; else the first agent's status. Agents still running ``STRAGGLER_GRACE_S``
    seconds after one finished the job (a node cut off from the rendezvous waits for it in
    vain) are stopped. With a ``run_dir``, each agent's output goes raw to
    ``<run_dir>/logs/agent_<i>.log`` and the console tells one line per event
    (:mod:`loomtrain.agent_log`).
    """
    started = time.time()
    story = None if run_dir is None else _story(cmds, run_dir)
    procs, pumps = _start_agents(cmds, env, story)
    stop_requested = []

    def forward(signum, frame) -> None:
        stop_requested.append(signum)
        if story is not None and story.stop_signal is None:
            story.stop_signal = signum
        _signal_all(procs, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = _wait_agents(procs, story, pumps)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return _job_status(codes, stop_requested, run_dir, started, story)


def _story(cmds: list[list[str]], run_dir: Path) -> Story:
    """The job's story, with one debug log per agent under ``<run_dir>/logs``."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    restarts = [int(a.split("=", 1)[1]) for a in cmds[0] if a.startswith("--max-restarts=")]
    return Story(run_dir, [logs / f"agent_{i}.log" for i in range(len(cmds))], restarts[0] if restarts else 0)


def _start_agents(cmds: list[list[str]], env: dict[str, str], story: Story | None):
    """Start every agent (dying with this launcher: preexec_fn runs in the child between fork
    and exec); with a story, its stdout and stderr are piped to one :class:`Pump` thread each.
    Returns the processes and, per agent, its pump threads."""
    if story is None:
        return [subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent) for cmd in cmds], []
    if sys.stderr.isatty():
        env = {**env, TTY_ENV: "1"}  # the workers' stderr is a pipe, but their bar ends on a terminal
    procs, pumps = [], []
    for i, cmd in enumerate(cmds):
        log = story.agents[i].log_path.open("ab")
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} launcher pid {os.getpid()}: {shlex.join(cmd)}\n".encode())
        proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)  # fmt: skip
        threads = [threading.Thread(target=Pump(story, i, log, console.buffer, pipe is proc.stderr).run,
                                    args=(pipe,), daemon=True)
                   for pipe, console in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]  # fmt: skip
        for t in threads:
            t.start()
        procs.append(proc)
        pumps.append(threads)
    return procs, pumps


def _job_status(codes: list[int], stop_requested: list[int], run_dir: Path | None, started: float,
                story: Story | None) -> int:  # fmt: skip
    """The launcher's exit status, and with a story its last line (stop or failure)."""
    if stop_requested:
        preempted = None if run_dir is None else _preemption_since(run_dir, started)
        code = 0 if preempted is not None else 1
        if story is not None:
            story.stopped(preempted, code)
        return code
    code = 0 if 0 in codes else codes[0]
    if code and story is not None:
        story.failed(codes, code)
    return code


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)


def _wait_agents(procs: list[subprocess.Popen], story: Story | None = None,
                 pumps: list[list[threading.Thread]] | None = None) -> list[int]:  # fmt: skip
    finished_at = None
    told = set()
    while any(p.poll() is None for p in procs):
        if finished_at is None and any(p.returncode == 0 for p in procs):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > STRAGGLER_GRACE_S:
            _signal_all(procs, signal.SIGKILL)
        if story is not None:
            _tell_exits(procs, story, pumps, told)
        time.sleep(0.2)
    if story is not None:
        _tell_exits(procs, story, pumps, told)
    return [p.returncode for p in procs]


def _tell_exits(procs: list[subprocess.Popen], story: Story, pumps: list[list[threading.Thread]],
                told: set[int]) -> None:  # fmt: skip
    """Tell the story of agents that ended since the last call, once their output is read
    (a worker's exit, which explains the agent's, comes through the pipe)."""
    story.flush_settled()
    for i, p in enumerate(procs):
        if p.returncode is None or i in told:
            continue
        for t in pumps[i]:
            t.join(timeout=PUMP_DRAIN_S)
        told.add(i)
        story.flush(i)
        if p.returncode != 0:
            story.agent_exited(i, p.returncode, any(q.poll() is None for q in procs))


def command_lines() -> Iterator[tuple[int, list[bytes]]]:
    """``(pid, argv)`` of every process on this machine whose ``/proc/<pid>/cmdline`` is
    readable (a process that ends meanwhile is skipped), for finding a job's processes."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue


def local_worker_pids(marker: str) -> list[int]:
    """PIDs of this machine's training workers (``python -u -m loomtrain.cli``, as torchrun
    starts them) whose command line contains ``marker`` (e.g. the run's out_dir); for fault
    injection in tests and the chaos benchmark."""
    return sorted(pid for pid, cmd in command_lines()
                  if b"-u" in cmd and b"loomtrain.cli" in cmd and any(marker.encode() in c for c in cmd))  # fmt: skip
