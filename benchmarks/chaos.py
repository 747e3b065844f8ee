"""Chaos benchmark: kill -9 a random rank at 3 random moments of an elastic run; does it recover?

The default Shakespeare job at world size 2 for 600 steps, checkpoints every 50, once cleanly
and once under ``loomtrain train --elastic`` with three SIGKILLs to a random worker at random
steps. Per fault: recovery time (kill to the restarted attempt's checkpoint load, seconds) and
steps redone. Writes ``benchmarks/results/chaos.json`` and prints, last,
``recovered N/3, max redo S steps, val loss delta D`` (D relative to the clean run).

    python benchmarks/chaos.py [--steps 600 --interval 50 --faults 3 --seed 0]
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
from pathlib import Path

from loomtrain.launch import local_worker_pids
from loomtrain.metrics import last_logged_step

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "chaos.json"


def train_cmd(out: Path, name: str, steps: int, interval: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "loomtrain.cli", "train", "--config", str(ROOT / "configs" / "shakespeare_char.toml"),
        "--nproc", "2", f"--run.out_dir={out}", f"--run.name={name}", f"--training.steps={steps}",
        f"--checkpoint.interval={interval}", "--training.log_interval=1", "--metrics.progress_bar=false",
        "--sample.max_new_tokens=0", *extra,
    ]  # fmt: skip


def inject_faults(proc: subprocess.Popen, run: Path, out: Path, targets: list[int], rng: random.Random) -> list[dict]:
    """Wait for each target step, then SIGKILL one random worker; returns the kill records."""
    kills = []
    for target in targets:
        while last_logged_step(run) < target and proc.poll() is None:
            time.sleep(0.05)
        pids = local_worker_pids(str(out))
        if proc.poll() is not None or not pids:
            break
        victim = rng.choice(pids)
        kills.append({"target_step": target, "step": last_logged_step(run), "time": time.time(), "pid": victim})
        os.kill(victim, signal.SIGKILL)
        while last_logged_step(run) >= target and proc.poll() is None and set(local_worker_pids(str(out))) & {victim}:
            time.sleep(0.05)
    return kills


def recoveries(run: Path, kills: list[dict]) -> list[dict]:
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    out = []
    for kill in kills:
        loaded = next((e for e in events if e["event"] == "checkpoint_loaded" and e["time"] > kill["time"]), None)
        redo = next((e for e in events if e["event"] == "steps_redone" and e["time"] > kill["time"]), None)
        out.append({
            **kill,
            "recovered": loaded is not None,
            "recovery_s": None if loaded is None else loaded["time"] - kill["time"],
            "resumed_step": None if loaded is None else loaded["step"],
            "steps_redone": 0 if redo is None else redo["count"],
        })  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--interval", type=int, default=50)
    p.add_argument("--faults", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="loomtrain-chaos-") as tmp:
        out = Path(tmp)
        subprocess.run(train_cmd(out, "clean", args.steps, args.interval), env=env, check=True, capture_output=True)
        targets = sorted(rng.sample(range(args.interval + 10, args.steps - 20), args.faults))
        start = time.time()
        proc = subprocess.Popen(
            train_cmd(out, "chaos", args.steps, args.interval, "--elastic", "--max-restarts", str(args.faults + 2)),
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        kills = inject_faults(proc, out / "chaos", out, targets, rng)
        code = proc.wait(timeout=3600)
        wall = time.time() - start
        faults = recoveries(out / "chaos", kills)
        clean = json.loads((out / "clean" / "summary.json").read_text())
        chaos = json.loads((out / "chaos" / "summary.json").read_text()) if code == 0 else {}
    delta = (chaos["val_loss"] - clean["val_loss"]) / clean["val_loss"] if chaos else None
    result = {
        "steps": args.steps, "checkpoint_interval": args.interval, "world_size": 2, "exit_code": code,
        "faults": faults, "recovered": sum(f["recovered"] for f in faults) if code == 0 else 0,
        "max_steps_redone": max((f["steps_redone"] for f in faults), default=0),
        "clean_val_loss": clean["val_loss"], "chaos_val_loss": chaos.get("val_loss"),
        "val_loss_rel_delta": delta, "chaos_wall_s": wall, "clean_wall_s": clean["wall_s"],
    }  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for f in faults:
        took = "not recovered" if f["recovery_s"] is None else f"recovered in {f['recovery_s']:.1f} s"
        print(f"kill at step {f['step']}: {took}, resumed at {f['resumed_step']}, {f['steps_redone']} steps redone")
    d = "n/a" if delta is None else f"{delta:+.4%}"
    redo = result["max_steps_redone"]
    print(f"recovered {result['recovered']}/{args.faults}, max redo {redo} steps, val loss delta {d}")


if __name__ == "__main__":
    main()
