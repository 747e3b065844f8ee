"""Chaos benchmark: does a job survive each kind of fault, how fast, and is the result unchanged?

Faults (issue #23), each against a clean run of the same job measured in the same invocation:

- ``worker``: ``kill -9`` of a random worker at ``--faults`` random steps of ``--elastic``
  ``--nproc 2``; every restart is same-size.
- ``shrink``: ``kill -9`` of one torchrun agent (a one-process node; its worker dies with it) of
  ``--elastic --nproc 3 --min-nproc 2``, not the one serving the c10d rendezvous store; the job
  goes on with 2 ranks.
- ``launcher``: ``kill -9`` of ``loomtrain train`` itself: no process of the job may be left
  after 10 s, and the same command started again with ``--resume auto`` resumes from the last
  checkpoint.
- ``host`` and ``rendezvous_host`` (root only): an emulated cluster of 3 hosts with
  ``--distributed.rendezvous=etcd``; every process of host 2, or of host 0 (which started the
  job), is killed; the job ends on the other two.

Per fault: finished (exit 0 and the last step reached), recovery seconds (kill, or for the
launcher the new start, to the checkpoint load of the resumed attempt), steps redone, and the
final validation loss's relative delta against the clean run (same-size: identical expected;
shrink: within 1e-4, the data-parallel degree reorders the sums). Writes
``benchmarks/results/chaos.json`` and prints ``recovered N/M`` last.

    python benchmarks/chaos.py [--steps 200 --interval 25 --faults 3 --seed 0 --cases worker,shrink,...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from loomtrain.cluster.emulated import ClusterSpec, emulated_cluster, missing_requirements
from loomtrain.cluster.etcd import missing_etcd
from loomtrain.launch import command_lines
from loomtrain.metrics import EventLog, last_logged_step

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "chaos.json"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# A global batch of 12 in micro-batches of 2 divides over 2 and 3 ranks alike.
JOB = ["--training.micro_batch_size=2", "--training.log_interval=1", "--metrics.progress_bar=false",
       "--sample.max_new_tokens=0", "--training.eval_interval=100000"]  # fmt: skip


class Job:
    """One training run's command line and directory."""

    def __init__(self, out: Path, name: str, steps: int, interval: int, *extra: str):
        self.run = out / name
        self.steps = steps
        config = str(ROOT / "configs" / "shakespeare_char.toml")
        self.cmd = [sys.executable, "-m", "loomtrain.cli", "train", "--config", config, f"--run.out_dir={out}",
                    f"--run.name={name}", f"--training.steps={steps}",
                    f"--checkpoint.interval={interval}", *JOB, *extra]  # fmt: skip

    def start(self, env: dict[str, str] = ENV) -> subprocess.Popen:
        return subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_for_step(self, step: int, proc: subprocess.Popen, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while last_logged_step(self.run) < step and proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.run.name}: step {step} not reached in {timeout_s} s")
            time.sleep(0.05)

    def val_loss(self) -> float | None:
        path = self.run / "summary.json"
        return json.loads(path.read_text())["val_loss"] if path.exists() else None


def pids_of(job: Job, needle: bytes) -> list[int]:
    """PIDs of ``job`` (its ``--run.name`` and ``--run.out_dir`` on their command line) whose
    command line holds ``needle``."""
    marks = [f"--run.name={job.run.name}".encode(), f"--run.out_dir={job.run.parent}".encode()]
    return sorted(pid for pid, cmd in command_lines() if needle in cmd and all(m in cmd for m in marks))


def serves_store(pid: int) -> bool:
    """Whether the torchrun agent ``pid`` hosts the c10d rendezvous store (``is_host=1``)."""
    return b"is_host=1" in Path(f"/proc/{pid}/cmdline").read_bytes()


def after(job: Job, since: float, kind: str) -> dict | None:
    """The first ``kind`` event of ``job`` logged at or after ``since`` (Unix s)."""
    return next((e for e in EventLog(job.run, enabled=False).read() if e["event"] == kind and e["time"] >= since), None)


def outcome(job: Job, code: int, since: float, clean: float | None, fault: str, **extra) -> dict:
    """One fault's row: finished, recovery seconds (and when the launcher saw the failure and
    the new attempt's trainer started: the rest is rendezvous and process start-up), steps
    redone and the val loss delta."""
    loaded, redo = after(job, since, "checkpoint_loaded"), after(job, since, "steps_redone")
    seen, started = after(job, since, "worker_failed"), after(job, since, "start")
    val = job.val_loss()
    return {
        "fault": fault, **extra, "exit_code": code, "finished": code == 0 and last_logged_step(job.run) == job.steps,
        "recovery_s": None if loaded is None else loaded["time"] - since,
        "failure_seen_s": None if seen is None else seen["time"] - since,
        "attempt_started_s": None if started is None else started["time"] - since,
        "resumed_step": None if loaded is None else loaded["step"],
        "steps_redone": 0 if redo is None else redo["count"],
        "val_loss": val, "val_loss_rel_delta": None if val is None or clean is None else (val - clean) / clean,
    }  # fmt: skip


def clean_run(out: Path, name: str, args, *extra: str, env: dict[str, str] = ENV) -> float:
    """The fault-free run's final validation loss (run once per name)."""
    job = Job(out, name, args.steps, args.interval, *extra)
    if job.val_loss() is None:
        subprocess.run(job.cmd, env=env, check=True, capture_output=True)
    return job.val_loss()


def worker_faults(out: Path, args, rng: random.Random) -> list[dict]:
    """Same-size restarts: ``args.faults`` kills of a random worker of a 2-process elastic job."""
    clean = clean_run(out, "clean2", args, "--nproc", "2")
    job = Job(out, "worker", args.steps, args.interval, "--nproc", "2", "--elastic", "--max-restarts",
              str(args.faults + 2))  # fmt: skip
    proc = job.start()
    kills = []
    for target in sorted(rng.sample(range(args.interval + 10, args.steps - 20), args.faults)):
        job.wait_for_step(target, proc)
        pids = pids_of(job, b"-u")
        if proc.poll() is not None or not pids:
            break
        victim = rng.choice(pids)
        kills.append((time.time(), last_logged_step(job.run)))
        os.kill(victim, signal.SIGKILL)
        while victim in pids_of(job, b"-u") and proc.poll() is None:
            time.sleep(0.05)
    code = proc.wait(timeout=3600)
    return [outcome(job, code, at, clean, "worker", killed_at_step=step) for at, step in kills]


def shrink_fault(out: Path, args, rng: random.Random) -> list[dict]:
    """A lost one-process node: its torchrun agent killed, the job goes on with 2 of 3 ranks."""
    clean = clean_run(out, "clean3", args, "--nproc", "3")
    job = Job(out, "shrink", args.steps, args.interval, "--nproc", "3", "--elastic", "--min-nproc", "2",
              "--max-restarts", "3")  # fmt: skip
    proc = job.start()
    job.wait_for_step(rng.randrange(args.interval + 5, 2 * args.interval), proc)
    # Not the agent serving the c10d rendezvous store (is_host=1): its loss ends the job, as
    # losing host 0 does without etcd (the "rendezvous_host" case).
    agent = rng.choice([p for p in pids_of(job, b"torch.distributed.run") if not serves_store(p)])
    at, step = time.time(), last_logged_step(job.run)
    os.kill(agent, signal.SIGKILL)
    code = proc.wait(timeout=3600)
    return [outcome(job, code, at, clean, "shrink", killed_at_step=step)]


def launcher_fault(out: Path, args, rng: random.Random) -> list[dict]:
    """``kill -9`` of the launcher: no orphan within 10 s, and a new start resumes."""
    clean = clean_run(out, "clean2", args, "--nproc", "2")
    job = Job(out, "launcher", args.steps, args.interval, "--nproc", "2", "--elastic")
    proc = job.start()
    job.wait_for_step(rng.randrange(args.interval + 5, 2 * args.interval), proc)
    step = last_logged_step(job.run)
    proc.kill()
    proc.wait()
    deadline, left = time.monotonic() + 10, [1]
    while left and time.monotonic() < deadline:
        left = pids_of(job, b"loomtrain.cli")
        time.sleep(0.1)
    restart = time.time()
    code = subprocess.run([*job.cmd, "--resume", "auto"], env=ENV, capture_output=True).returncode
    return [outcome(job, code, restart, clean, "launcher", killed_at_step=step, orphans_after_10s=len(left))]


def host_faults(out: Path, args, rng: random.Random) -> list[dict]:
    """Host 2, then (another run) host 0 of a 3-host cluster with etcd rendezvous, killed."""
    state = out / "clusters"
    env = {**ENV, "LOOMTRAIN_CLUSTER_DIR": str(state)}
    spec = ClusterSpec(hosts=3, procs_per_host=1, inter_rate="1gbit", name="c" + uuid.uuid4().hex[:6])
    rows = []
    with emulated_cluster(spec, state_dir=state) as c:
        on_cluster = ["--cluster", c.spec.name, "--distributed.rendezvous=etcd", "--distributed.timeout_s=30"]
        clean = clean_run(out, "clean_hosts", args, *on_cluster, env=env)
        for host, fault in ((2, "host"), (0, "rendezvous_host")):
            job = Job(out, fault, args.steps, args.interval, *on_cluster, "--elastic", "--min-nodes=2",
                      "--max-restarts=3")  # fmt: skip
            proc = job.start(env)
            job.wait_for_step(rng.randrange(args.interval + 5, 2 * args.interval), proc)
            at, step = time.time(), last_logged_step(job.run)
            c.kill_host(host)
            code = proc.wait(timeout=3600)
            rows.append(outcome(job, code, at, clean, fault, killed_at_step=step))
    return rows


CASES = {"worker": worker_faults, "shrink": shrink_fault, "launcher": launcher_fault, "host": host_faults}


def runnable(cases: list[str]) -> tuple[list[str], dict[str, str]]:
    """The cases this machine can run, and why the others cannot."""
    why = missing_requirements() or missing_etcd()
    skipped = {"host": why} if "host" in cases and why else {}
    return [c for c in cases if c not in skipped], skipped


def report(rows: list[dict], skipped: dict[str, str]) -> None:
    for r in rows:
        took = "not recovered" if r["recovery_s"] is None else f"recovered in {r['recovery_s']:.1f} s"
        delta = "n/a" if r["val_loss_rel_delta"] is None else f"{r['val_loss_rel_delta']:+.2e}"
        extra = f", {r['orphans_after_10s']} orphans after 10 s" if "orphans_after_10s" in r else ""
        print(f"{r['fault']:>15} kill at step {r['killed_at_step']}: finished={r['finished']}, {took}, "
              f"{r['steps_redone']} steps redone, val loss delta {delta}{extra}")  # fmt: skip
    for case, why in skipped.items():
        print(f"{case:>15} skipped: {why}")
    print(f"recovered {sum(r['finished'] for r in rows)}/{len(rows)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--interval", type=int, default=25)
    p.add_argument("--faults", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    rng = random.Random(args.seed)
    cases, skipped = runnable(args.cases.split(","))
    rows = []
    with tempfile.TemporaryDirectory(prefix="loomtrain-chaos-") as tmp:
        for case in cases:
            rows += CASES[case](Path(tmp), args, rng)
    result = {"steps": args.steps, "checkpoint_interval": args.interval, "faults": rows, "skipped": skipped,
              "recovered": sum(r["finished"] for r in rows), "total": len(rows)}  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    report(rows, skipped)


if __name__ == "__main__":
    main()
