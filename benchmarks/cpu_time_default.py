"""Where the default job's CPU goes, per thread: 1 process at batch 12 against 2 processes at 6 each.

Runs ``train()`` in spawned processes (one torch thread each) for ``--short`` and ``--long``
steps and reads every thread's CPU seconds from ``/proc/self/task/*/stat`` (utime + stime,
proc(5)) around it; the difference between the two runs is ``--long - --short`` steps with
start-up, data loading and the first steps dropped out. Prints, per step, rank 0's wall time,
its main thread's CPU, gloo's threads' CPU and the idle rest (wall minus all CPU: waiting for
the other rank or the network). Linux only. Writes ``benchmarks/results/cpu_time_default.json``.

    python benchmarks/cpu_time_default.py [--short 50 --long 350]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from bench_default import rank_config

from loomtrain.distributed.spawn import spawn
from loomtrain.trainer import train

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "cpu_time_default.json"


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each live thread of this process, keyed ``<tid>:<name>``."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out[f"{task.name}:{name}"] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def run(steps: int, out_dir: str) -> dict[str, float]:
    """Wall seconds and CPU seconds (main thread, others) of one default-job run on this rank."""
    torch.set_num_threads(1)
    cfg = rank_config(steps, out_dir)
    before, start = thread_cpu_s(), time.perf_counter()
    train(cfg)
    wall, after = time.perf_counter() - start, thread_cpu_s()
    main = f"{os.getpid()}:"
    spent = {k: v - before.get(k, 0.0) for k, v in after.items()}
    main_s = sum(v for k, v in spent.items() if k.startswith(main))
    return {"wall_s": wall, "main_cpu_s": main_s, "other_cpu_s": sum(spent.values()) - main_s}


def per_step(short: dict, long: dict, steps: int) -> dict[str, float]:
    ms = {k.replace("_s", "_ms_per_step"): 1000 * (long[k] - short[k]) / steps for k in long}
    ms["idle_ms_per_step"] = ms["wall_ms_per_step"] - ms["main_cpu_ms_per_step"] - ms["other_cpu_ms_per_step"]
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", type=int, default=50)
    p.add_argument("--long", type=int, default=350)
    args = p.parse_args()
    result = {"config": vars(args), "torch": torch.__version__}
    for world in (1, 2):
        runs = [spawn(run, world, steps, f"/tmp/loomtrain-cpu-time-{world}", timeout_s=900)[0]
                for steps in (args.short, args.long)]  # fmt: skip
        result[f"{world}_process"] = per_step(*runs, args.long - args.short)
        print(f"{world} process(es), rank 0, per step:", ", ".join(
            f"{k.removesuffix('_ms_per_step')} {v:.1f} ms" for k, v in result[f"{world}_process"].items()))  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
