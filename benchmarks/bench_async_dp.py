"""Asynchronous local SGD against synchronous DP and DiLoCo (issue #16): with one slow rank, and
on emulated hosts over a slow link. Needs root (cgroup CPU throttling, ``cluster/throttle.py``;
network namespaces and tc, ``cluster/emulated.py``).

Part ``throttled``: three training ranks, each limited by the kernel's CFS bandwidth control to a fraction of one
core and pinned (``simulate.rank_speed``): two at ``FAST`` and one at a quarter of that
(``SLOW``). Every run trains the same tokens (``steps`` × ``global_batch_size`` samples of
``seq_len``) of the same model and data from the same seed:

- ``sync``: synchronous DP on the 3 ranks (uniform split: every step waits for the slow rank);
- ``diloco``: DiLoCo on the 3 ranks, ``H`` inner steps (the outer all-reduce waits for it too);
- ``async``: 4 processes, rank 0 the server (at ``SERVER`` of a core: it only applies deltas) and
  the 3 ranks as workers, ``H`` inner steps per round; the fast workers take more rounds.
  Run twice: ``max_staleness = 4`` (the default: the slow worker's deltas, about 8 updates
  stale, are rejected) and ``max_staleness = 16`` (they are applied, scaled by 1/(1+τ)).

Reported per run: training tokens/s (``summary.json``: the job's tokens over the training
seconds, for async the server's seconds from its first round to its last), final validation
loss of the one model the run ends with (same fixed validation set), wall seconds, bytes per
step, and for async the staleness counts; then the ratios against ``sync`` of the same
invocation (a shared machine: only ratios from one invocation are comparable).

Part ``link``: world 4 on 2 emulated hosts × 2 processes whose links run at ``LINK_RATE`` each
way (``loomtrain train --cluster``), no throttling: ``sync`` and ``diloco`` on the 4 ranks,
``async`` with the server and one worker on host 0 and two workers on host 1; the same figures
plus the bytes that crossed the host links per step (tc counters). Global batch 24 (whole
micro-batches of 2 for 4 sync ranks and for 3 async workers).

    python benchmarks/bench_async_dp.py [--part throttled|link|all] [--quick] [--out FILE]

Writes ``benchmarks/results/async_dp.json`` (a part run alone keeps the file's other part;
``--quick``: a smoke test of a few steps, written to the temp directory instead) and prints a
table per part with async's tokens/s ratio over sync, then (link part) DiLoCo's validation loss
ratio and, last, its bytes ratio (``diloco_val_loss_ratio``, ``diloco_bytes_ratio`` in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from loomtrain.cluster.emulated import ClusterSpec, emulated_cluster, missing_requirements
from loomtrain.cluster.throttle import sweep_stale, throttle_requirements
from loomtrain.config import toml_value

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "shakespeare_char.toml"
RESULTS = ROOT / "benchmarks" / "results"
FAST, SLOW, SERVER = 0.6, 0.15, 0.25  # cores: 0.6 + 0.25 and 0.6 + 0.15, each within 0.9
MODEL = ["--model.dim=128", "--model.n_layers=2", "--model.n_heads=4", "--model.max_seq_len=64",
         "--training.seq_len=64", "--training.global_batch_size=12", "--training.micro_batch_size=2"]  # fmt: skip
COMMON = ["--metrics.progress_bar=false", "--sample.max_new_tokens=0", "--checkpoint.enabled=false",
          "--metrics.tensorboard=false", "--training.eval_batches=16",
          "--distributed.probe_topology=false"]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LINK_RATE = "100mbit"
FULL = {"steps": 300, "inner_steps": 10, "link_steps": 150}
QUICK = {"steps": 20, "inner_steps": 5, "link_steps": 10}


def runs(plan: dict) -> dict[str, tuple[int, list[str]]]:
    """Each run's process count and CLI arguments (besides the config file, names, ``MODEL``,
    ``COMMON``)."""
    steps, h = plan["steps"], plan["inner_steps"]
    three = f"--simulate.rank_speed={toml_value([FAST, FAST, SLOW])}"
    four = f"--simulate.rank_speed={toml_value([SERVER, FAST, FAST, SLOW])}"
    base = [f"--training.steps={steps}", f"--training.eval_interval={steps}", f"--training.decay_steps={steps}",
            f"--training.warmup_steps={steps // 10}"]  # fmt: skip
    async_ = [*base, four, "--data_parallel.mode=async", f"--data_parallel.inner_steps={h}"]
    return {
        "sync": (3, [*base, three]),
        "diloco": (3, [*base, three, "--data_parallel.mode=diloco", f"--data_parallel.inner_steps={h}"]),
        "async_staleness4": (4, async_),
        "async_staleness16": (4, [*async_, "--data_parallel.max_staleness=16"]),
    }


def link_runs(plan: dict) -> dict[str, list[str]]:
    """Each link run's CLI arguments (world 4 on the emulated cluster)."""
    steps, h = plan["link_steps"], plan["inner_steps"]
    base = [f"--training.steps={steps}", f"--training.eval_interval={steps}", f"--training.decay_steps={steps}",
            f"--training.warmup_steps={steps // 10}", f"--training.log_interval={steps}",
            "--training.global_batch_size=24"]  # fmt: skip  # whole micro-batches for 4 ranks and for 3 workers
    return {
        "sync": base,
        "diloco": [*base, "--data_parallel.mode=diloco", f"--data_parallel.inner_steps={h}"],
        "async": [*base, "--data_parallel.mode=async", f"--data_parallel.inner_steps={h}"],
    }


def train(work: Path, name: str, nproc: int, extra: list[str], cluster: str | None = None) -> tuple[Path, float]:
    """One ``loomtrain train`` run as a subprocess (``nproc`` local processes, or on the emulated
    ``cluster``); returns its run directory and wall seconds.

    Raises:
        RuntimeError: the run failed; the message holds the command and the end of its stderr.
    """
    where = ["--nproc", str(nproc)] if cluster is None else ["--cluster", cluster]
    cmd = [sys.executable, "-m", "loomtrain.cli", "train", "--config", str(CONFIG), *where,
           f"--run.out_dir={work}", f"--run.name={name}", "--overwrite", *MODEL, *COMMON, *extra]  # fmt: skip
    start = time.perf_counter()
    env = ENV if cluster is None else {**ENV, "LOOMTRAIN_CLUSTER_DIR": str(work / "clusters")}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\nexited {proc.returncode}:\n{proc.stderr[-4000:]}")
    wall = time.perf_counter() - start
    print(f"  {name}: {wall:.0f} s", flush=True)
    return work / name, wall


def summarize(run: Path, wall_s: float) -> dict:
    """The figures of one run from its ``summary.json`` (and, for async, its rounds per worker
    from ``metrics.jsonl``)."""
    s = json.loads((run / "summary.json").read_text())
    out = {"tokens_per_s": s["tokens_per_s"], "val_loss": s["val_loss"], "train_wall_s": s["wall_s"],
           "process_wall_s": wall_s, "comm_bytes_per_step": s["comm_bytes_per_step"]}  # fmt: skip
    if "staleness_applied" in s:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rounds: dict[str, int] = {}
        for r in records:
            rounds[str(r["worker"])] = rounds.get(str(r["worker"]), 0) + 1
        out.update({"staleness_applied": s["staleness_applied"], "staleness_rejected": s["staleness_rejected"],
                    "outer_steps": s["outer_steps"], "rounds_per_worker": rounds})  # fmt: skip
    return out


def with_ratios(result: dict) -> dict:
    """``result`` (name → figures) with each run's tokens/s and val loss over ``sync``'s."""
    sync = result["sync"]
    for r in result.values():
        r["tokens_per_s_vs_sync"] = r["tokens_per_s"] / sync["tokens_per_s"]
        r["val_loss_vs_sync"] = r["val_loss"] / sync["val_loss"]
    return result


def measure_throttled(plan: dict, work: Path) -> dict:
    """Part ``throttled``: every run of :func:`runs`, with ratios against ``sync``."""
    try:
        result = {name: summarize(*train(work, name, nproc, extra)) for name, (nproc, extra) in runs(plan).items()}
    finally:
        sweep_stale()  # a run killed while throttled leaves its cgroup behind
    return {"rank_speeds": {"fast": FAST, "slow": SLOW, "server": SERVER}, "steps": plan["steps"],
            "configs": {k: {"nproc": n, "args": a} for k, (n, a) in runs(plan).items()},
            "runs": with_ratios(result)}  # fmt: skip


def measure_link(plan: dict, work: Path) -> dict:
    """Part ``link``: every run of :func:`link_runs` on 2 emulated hosts × 2 processes, with the
    bytes that crossed the host links per step (both directions of both links, tc counters)."""
    spec = ClusterSpec(hosts=2, procs_per_host=2, inter_rate=LINK_RATE, name="bad")
    result = {}
    with emulated_cluster(spec, state_dir=work / "clusters") as cluster:
        for name, extra in link_runs(plan).items():
            before = sum(sum(cluster.link_bytes(h)) for h in range(2))
            figures = summarize(*train(work, f"link_{name}", 4, extra, cluster=spec.name))
            crossed = sum(sum(cluster.link_bytes(h)) for h in range(2)) - before
            result[name] = {**figures, "link_bytes_per_step": crossed / plan["link_steps"]}
    return {"hosts": 2, "procs_per_host": 2, "inter_rate": LINK_RATE, "steps": plan["link_steps"],
            "configs": link_runs(plan), "runs": with_ratios(result)}  # fmt: skip


def diloco_ratios(runs_: dict) -> dict[str, float]:
    """Issue #16's two headline figures from the link part: ``diloco_val_loss_ratio`` (DiLoCo's
    final validation loss over sync DP's) and ``diloco_bytes_ratio`` (sync DP's bytes per step
    over DiLoCo's, as the gradient hooks count them)."""
    sync, diloco = runs_["sync"], runs_["diloco"]
    return {"diloco_val_loss_ratio": diloco["val_loss"] / sync["val_loss"],
            "diloco_bytes_ratio": sync["comm_bytes_per_step"] / diloco["comm_bytes_per_step"]}  # fmt: skip


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    return {"cpu": model, "cpu_count": os.cpu_count(), "kernel": platform.release(), "torch": torch.__version__,
            "python": platform.python_version(), "load_average_at_start": os.getloadavg()}  # fmt: skip


def print_table(part: str, result: dict) -> None:
    print(f"{part}:\n{'run':<20} {'tokens/s':>10} {'vs sync':>8} {'val loss':>9} {'vs sync':>8} {'bytes/step':>11}")
    for name, r in result["runs"].items():
        print(f"{name:<20} {r['tokens_per_s']:>10.0f} {r['tokens_per_s_vs_sync']:>8.3f} {r['val_loss']:>9.4f} "
              f"{r['val_loss_vs_sync']:>8.3f} {r['comm_bytes_per_step']:>11.0f}")  # fmt: skip
    for name, r in result["runs"].items():
        if "rounds_per_worker" in r:
            print(f"{name}: rounds per worker {r['rounds_per_worker']}, staleness applied {r['staleness_applied']}, "
                  f"rejected {r['staleness_rejected']}")  # fmt: skip
    name = "async_staleness16" if part == "throttled" else "async"
    print(f"{part}: {name} tokens/s over sync: {result['runs'][name]['tokens_per_s_vs_sync']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["throttled", "link", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="a few steps each: a smoke test, not a measurement")
    parser.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/async_dp.json)")
    args = parser.parse_args()
    parts = ["throttled", "link"] if args.part == "all" else [args.part]
    for reason in (throttle_requirements() if "throttled" in parts else None,
                   missing_requirements() if "link" in parts else None):  # fmt: skip
        if reason is not None:
            sys.exit(f"error: {reason}")
    plan = QUICK if args.quick else FULL
    out = args.out or (Path(tempfile.gettempdir()) if args.quick else RESULTS) / "async_dp.json"
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update({"model": MODEL, "common": COMMON, "plan": plan})
    work = Path(tempfile.mkdtemp(prefix="bench_async_dp_"))
    try:
        for part in parts:
            start, host = time.perf_counter(), machine()
            date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            measured = measure_throttled(plan, work) if part == "throttled" else measure_link(plan, work)
            result[part] = {"machine": host, "date": date, "wall_s": time.perf_counter() - start, **measured}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "link" in result:
        result.update(diloco_ratios(result["link"]["runs"]))
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    for part in ("throttled", "link"):
        if part in result:
            print_table(part, result[part])
    if "link" in result:
        print(f"link: diloco val loss / sync: {result['diloco_val_loss_ratio']:.3f}")
        print(f"link: sync bytes / diloco bytes: {result['diloco_bytes_ratio']:.1f}")


if __name__ == "__main__":
    main()
