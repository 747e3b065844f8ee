"""Starting local workers through torchrun: plain, or elastic with restarts.

- Plain (``--nproc N``): one torchrun agent, ``--standalone``, N workers; a failure ends the job.
- Elastic (``--elastic``): c10d rendezvous and ``--max-restarts``. With a fixed size, one agent
  runs N workers and restarts all of them when one dies. With ``--min-nproc A --max-nproc B``,
  each worker gets an agent of its own (a one-process "node"), so losing one shrinks the job to
  the survivors (down to A) and a new one can join (up to B), as whole nodes do across hosts.
  Every attempt resumes from the newest complete checkpoint.

The launcher passes SIGTERM and SIGINT on to the agents, which pass them to the workers; the
workers checkpoint at the current step and stop. The launcher then exits 0 if the event log
shows that preemption checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loomtrain.distributed.spawn import free_port
from loomtrain.metrics import EventLog


@dataclass(frozen=True)
class ElasticSpec:
    """Elastic launch bounds (processes on this machine) and how often the agents may restart."""

    min_nproc: int
    max_nproc: int
    max_restarts: int


def agent_commands(nproc: int, worker_argv: list[str], elastic: ElasticSpec | None, run_id: str) -> list[list[str]]:
    """One torchrun command line per agent to start."""
    base = [sys.executable, "-m", "torch.distributed.run"]
    worker = ["-m", "loomtrain.cli", "train", *worker_argv]
    if elastic is None:
        return [[*base, "--standalone", f"--nproc-per-node={nproc}", *worker]]
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}",
            f"--max-restarts={elastic.max_restarts}"]  # fmt: skip
    if elastic.min_nproc == elastic.max_nproc == nproc:
        return [[*base, *rdzv, "--nnodes=1", f"--nproc-per-node={nproc}", *worker]]
    nnodes = f"--nnodes={elastic.min_nproc}:{elastic.max_nproc}"
    # All agents share this host, so say which one serves the rendezvous store.
    return [
        [*base, *rdzv, nnodes, "--nproc-per-node=1", f"--rdzv-conf=is_host={int(i == 0)}", *worker]
        for i in range(nproc)
    ]


def _preempted_since(run_dir: Path, since: float) -> bool:
    events = EventLog(run_dir, enabled=False).read()
    return any(e["event"] == "preempted" and e["time"] >= since for e in events)


def launch(nproc: int, worker_argv: list[str], elastic: ElasticSpec | None, run_dir: Path, run_id: str) -> int:
    """Run the agents to completion; returns the job's exit status (0: finished or preempted
    with a checkpoint)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if elastic is not None:
        # Restarted gloo workers otherwise may reuse the previous attempt's store address and
        # hang (pytorch issue 135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    started = time.time()
    procs = [subprocess.Popen(cmd, env=env) for cmd in agent_commands(nproc, worker_argv, elastic, run_id)]
    stop_requested = []

    def forward(signum, frame) -> None:
        stop_requested.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stop_requested:
        return 0 if _preempted_since(run_dir, started) else 1
    # With one agent per worker, an agent whose process was lost exits non-zero while the
    # survivors finish the job: the job succeeded if any agent did.
    return 0 if 0 in codes else codes[0]


def local_worker_pids(marker: str) -> list[int]:
    """PIDs of this machine's training workers (``python -u -m loomtrain.cli``, as torchrun
    starts them) whose command line contains ``marker`` (e.g. the run's out_dir); for fault
    injection in tests and the chaos benchmark."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-u" in cmd and b"loomtrain.cli" in cmd and any(marker.encode() in c for c in cmd):
            pids.append(int(entry.name))
    return sorted(pids)
