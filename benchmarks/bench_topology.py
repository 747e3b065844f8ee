"""Multi-host: flat vs hierarchical all-reduce on emulated hosts, and what compression buys on a
slow link at equal wall-clock time. Needs root (network namespaces, tc); see docs/topology.md.

Part 1, collectives: 2 emulated hosts × 2 (and × 4) processes, inter-host links shaped to
100 Mbit/s by tbf, intra-host unshaped. ``loomtrain bench collectives`` times all-reduce from
1 KiB to 64 MiB, flat, hierarchical and ``auto`` interleaved (median of repeats), and reads the
host links' tc counters around every call: ``link_utilization`` is the busiest host link's bytes
over elapsed time × rate. Targets: hierarchical keeps the link >= 85 % busy at >= 16 MiB;
hierarchical algbw >= 1.3x flat's at >= 16 MiB; auto >= 0.95x the better of the two from 64 KiB.

Part 2, compression's payoff: the default job (``configs/shakespeare_char.toml``) on 2 hosts ×
2 processes. Each setting's step time is measured on the shaped link over ``--shaped-steps``
steps; T = 2000 × flat's. Each setting then trains the steps that fit in T at its own step
time, with its learning-rate schedule sized to them, on an unshaped cluster (losses do not
depend on the link); its validation curve paired with its shaped step time gives the wall time
at which it first reaches flat's final validation loss. One setting (``--end-to-end``) is also
run whole on the shaped link, and its measured training time is compared with the projection
(within 5 % validates the method). The bytes that crossed the host links per step are read from
the tc counters and set beside what the hierarchical hook counted.

    python benchmarks/bench_topology.py [--part collectives|payoff|all] [--steps 2000]
        [--shaped-steps 300] [--end-to-end hier_topk_ramp] [--max-bytes 64M] [--out FILE]

Writes ``benchmarks/results/topology.json``; prints the best compressed setting's
time-to-loss / T last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loomtrain.cluster.emulated import ClusterSpec, emulated_cluster, missing_requirements

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "shakespeare_char.toml"
RESULTS = ROOT / "benchmarks" / "results" / "topology.json"
RATE = "100mbit"
MIB = 2**20
TOKENS_PER_STEP = 12 * 64  # the default job's global batch × sequence length
LOG_WINDOW = 20  # steps per logged record when timing on the shaped link; divides RAMP
SETTINGS = {
    "flat": ["--data_parallel.comm_hook=allreduce"],
    "hierarchical": ["--data_parallel.comm_hook=hierarchical"],
    "hier_powersgd": ["--data_parallel.comm_hook=hierarchical", "--compression.method=powersgd",
                      "--compression.powersgd_rank=4"],
    "hier_topk_ramp": ["--data_parallel.comm_hook=hierarchical", "--compression.method=topk",
                       "--compression.topk_ratio=0.01", "--compression.warmup_steps=200",
                       "--compression.topk_warmup_density=0.25"],
}  # fmt: skip
COMPRESSED = ("hier_powersgd", "hier_topk_ramp")
RAMP = {"hier_topk_ramp": 200}  # steps of the compressor's warm-up, whose step time differs
JOB = ["--training.micro_batch_size=3", "--metrics.progress_bar=false", "--sample.max_new_tokens=0",
       "--checkpoint.interval=1000000", "--metrics.tensorboard=false"]  # fmt: skip


def bench_collectives(hosts: int, procs: int, max_bytes: str, work: Path) -> list[dict]:
    """The all-reduce rows of ``loomtrain bench collectives`` on ``hosts × procs`` emulated ranks."""
    out = work / f"collectives_{hosts}x{procs}.json"
    spec = ClusterSpec(hosts=hosts, procs_per_host=procs, inter_rate=RATE, name=f"bt{procs}")
    with emulated_cluster(spec, state_dir=work / "clusters") as c:
        cmd = [sys.executable, "-m", "loomtrain.cli", "bench", "collectives", "--cluster", c.spec.name,
               "--ops", "all_reduce", "--min-bytes", "1K", "--max-bytes", max_bytes, "--link-rate", RATE,
               "--link-device", c.interface, "--iters", "3", "--max-seconds", "1", "--json", str(out)]  # fmt: skip
        subprocess.run(cmd, env=_env(work), check=True)
    return json.loads(out.read_text())["rows"]


def summarize_collectives(rows: list[dict]) -> dict:
    """Per size: algbw per mode, hierarchical/flat, auto/best, link utilization; and the targets."""
    by = {(r["bytes"], r["mode"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    table = []
    for s in sizes:
        flat, hier, auto = by[(s, "flat")], by[(s, "hierarchical")], by[(s, "auto")]
        table.append({"bytes": s, "flat_algbw": flat["algbw"], "hierarchical_algbw": hier["algbw"],
                      "auto_algbw": auto["algbw"], "auto_path": auto["path"],
                      "hierarchical_over_flat": hier["algbw"] / flat["algbw"],
                      "auto_over_best": auto["algbw"] / max(flat["algbw"], hier["algbw"]),
                      "flat_busbw": flat["busbw"], "hierarchical_busbw": hier["busbw"],
                      "flat_link_utilization": flat["link_utilization"],
                      "hierarchical_link_utilization": hier["link_utilization"]})  # fmt: skip
    big = [t for t in table if t["bytes"] >= 16 * MIB]
    from64k = [t for t in table if t["bytes"] >= 64 * 1024]
    return {
        "sizes": table,
        "hierarchical_link_fraction": min(t["hierarchical_link_utilization"] for t in big) if big else None,
        "min_hierarchical_over_flat_16m": min(t["hierarchical_over_flat"] for t in big) if big else None,
        "min_auto_over_best_64k": min(t["auto_over_best"] for t in from64k) if from64k else None,
    }


def _env(work: Path) -> dict[str, str]:
    return {**os.environ, "LOOMTRAIN_CLUSTER_DIR": str(work / "clusters"), "OMP_NUM_THREADS": "1"}


def train_on(cluster, work: Path, name: str, steps: int, extra: list[str]) -> Path:
    """Train the default job for ``steps`` steps on ``cluster``; returns the run directory."""
    cmd = [sys.executable, "-m", "loomtrain.cli", "train", "--cluster", cluster.spec.name, "--config", str(CONFIG),
           *JOB, f"--training.steps={steps}", f"--run.out_dir={work / 'runs'}", f"--run.name={name}",
           "--overwrite", *extra]  # fmt: skip
    subprocess.run(cmd, env=_env(work), check=True, stdout=subprocess.DEVNULL)
    return work / "runs" / name


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def phase_times(run: Path, ramp: int) -> list[tuple[float, float]]:
    """``[(last step, mean seconds per step)]``: the compressor's warm-up ramp (steps ``1..ramp``)
    and the steady phase after it (open-ended), from the logged records (each a window of
    ``LOG_WINDOW`` steps). Step 1 (lazy set-up, logged alone) is left out of the means."""
    times = {r["step"]: TOKENS_PER_STEP / r["tokens_per_s"] for r in records(run) if r["step"] > 1}
    steady = statistics.mean(t for s, t in times.items() if s > ramp)
    if ramp == 0:
        return [(math.inf, steady)]
    return [(ramp, statistics.mean(t for s, t in times.items() if s <= ramp)), (math.inf, steady)]


def elapsed(phases: list[tuple[float, float]], step: int) -> float:
    """Projected training seconds after ``step`` steps."""
    total, start = 0.0, 0
    for last, step_s in phases:
        n = min(step, last) - start
        if n <= 0:
            break
        total, start = total + n * step_s, start + n
    return total


def steps_within(phases: list[tuple[float, float]], budget: float) -> int:
    """The most steps whose projected training time fits in ``budget`` seconds."""
    steps, spent = 0, 0.0
    for last, step_s in phases:
        n = min(last - steps, int((budget - spent) / step_s))
        steps, spent = steps + n, spent + n * step_s
        if steps < last:
            break
    return int(steps)


def training_seconds(run: Path) -> float:
    """Seconds spent inside training steps over the whole run (evaluation left out)."""
    summary = json.loads((run / "summary.json").read_text())
    return summary["final_step"] * TOKENS_PER_STEP / summary["tokens_per_s"]


def val_curve(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in records(run) if "val_loss" in r]


def measure_shaped(work: Path, shaped_steps: int) -> dict[str, dict]:
    """Per setting: step times on the shaped link (its ramp and steady phases), and the bytes
    that crossed the host links per step (tc counters vs what the hook counted)."""
    out = {}
    spec = ClusterSpec(hosts=2, procs_per_host=2, inter_rate=RATE, name="btsh")
    with emulated_cluster(spec, state_dir=work / "clusters") as c:
        for name, extra in SETTINGS.items():
            steps = RAMP.get(name, 0) + shaped_steps
            before = [c.link_bytes(h)[0] for h in range(2)]
            # Logging every step would add two small all-reduces over the slow link per step
            # (outside the timed step, but syncing the ranks): the long runs log every 20 to 150.
            timing = [f"--training.log_interval={LOG_WINDOW}", "--training.eval_interval=1000000"]
            run = train_on(c, work, f"shaped_{name}", steps, [*extra, *timing])
            sent = sum(c.link_bytes(h)[0] - b for h, b in zip(range(2), before, strict=True))
            hook = records(run)[-1].get("comm_bytes_dp_inter_host")
            phases = phase_times(run, RAMP.get(name, 0))
            out[name] = {"phases": phases, "steady_step_s": phases[-1][1], "tc_link_bytes_per_step": sent / steps,
                         "hook_inter_host_bytes_per_step": None if hook is None else hook * 4}  # fmt: skip
            print(f"{name}: {phases[-1][1] * 1e3:.1f} ms/step (steady) on the shaped link, "
                  f"{sent / steps / 1e6:.3f} MB/step across host links (tc)", flush=True)  # fmt: skip
    return out


def loss_curves(work: Path, steps: dict[str, int]) -> dict[str, list[tuple[int, float]]]:
    """Each setting trained for its step count on an unshaped cluster: its validation curve."""
    curves = {}
    spec = ClusterSpec(hosts=2, procs_per_host=2, inter_rate="10gbit", name="btfast")
    with emulated_cluster(spec, state_dir=work / "clusters") as c:
        for name, n in steps.items():
            interval = max(50, n // 40)
            run = train_on(c, work, f"curve_{name}", n, [*SETTINGS[name], f"--training.eval_interval={interval}",
                                                         f"--training.log_interval={interval}"])  # fmt: skip
            curves[name] = val_curve(run)
            print(f"{name}: {n} steps, final val loss {curves[name][-1][1]:.4f}", flush=True)
    return curves


def time_to_loss(curve: list[tuple[int, float]], phases: list[tuple[float, float]], target: float) -> float | None:
    """Projected seconds at which ``curve`` first reaches ``target`` (None: never)."""
    return next((elapsed(phases, step) for step, loss in curve if loss <= target), None)


def bench_payoff(work: Path, total_steps: int, shaped_steps: int, end_to_end: str) -> dict:
    shaped = measure_shaped(work, shaped_steps)
    budget = elapsed(shaped["flat"]["phases"], total_steps)
    steps = {name: steps_within(m["phases"], budget) for name, m in shaped.items()}
    steps["flat"] = total_steps
    curves = loss_curves(work, steps)
    target = curves["flat"][-1][1]
    settings = {}
    for name in SETTINGS:
        reach = time_to_loss(curves[name], shaped[name]["phases"], target)
        settings[name] = {**shaped[name], "steps_in_T": steps[name], "final_val_loss": curves[name][-1][1],
                          "time_to_flat_loss_s": reach, "time_to_flat_loss_over_T": None if reach is None else
                          reach / budget, "val_curve": curves[name]}  # fmt: skip
    check = end_to_end_check(work, end_to_end, steps[end_to_end], elapsed(shaped[end_to_end]["phases"],
                                                                          steps[end_to_end]))  # fmt: skip
    return {"T_s": budget, "target_val_loss": target, "settings": settings, "end_to_end": check}


def end_to_end_check(work: Path, name: str, steps: int, projected: float) -> dict:
    """Run ``name`` whole on the shaped link; its training time against the projection."""
    spec = ClusterSpec(hosts=2, procs_per_host=2, inter_rate=RATE, name="btsh")
    with emulated_cluster(spec, state_dir=work / "clusters") as c:
        interval = max(50, steps // 40)
        run = train_on(c, work, f"e2e_{name}", steps, [*SETTINGS[name], f"--training.eval_interval={interval}",
                                                       f"--training.log_interval={interval}"])  # fmt: skip
    measured = training_seconds(run)
    print(f"end to end {name}: {measured:.0f} s measured, {projected:.0f} s projected", flush=True)
    return {"setting": name, "steps": steps, "measured_s": measured, "projected_s": projected,
            "measured_over_projected": measured / projected, "final_val_loss": val_curve(run)[-1][1]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["collectives", "payoff", "all"], default="all")
    p.add_argument("--steps", type=int, default=2000, help="flat's steps; T = steps × flat's shaped step time")
    p.add_argument("--shaped-steps", type=int, default=300, help="steps timed per setting on the shaped link")
    p.add_argument("--end-to-end", choices=sorted(SETTINGS), default="hier_topk_ramp")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--layouts", default="2x2,2x4", help="hosts x procs for part 1")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    reason = missing_requirements()
    if reason:
        sys.exit(f"error: {reason}")
    # SIGTERM as an exception, so the emulated clusters are taken down on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.part in ("collectives", "all"):
            result["collectives"] = run_collectives(args, work)
        if args.part in ("payoff", "all"):
            result["payoff"] = bench_payoff(work, args.steps, args.shaped_steps, args.end_to_end)
    result.update(machine=os.uname().nodename, link_rate=RATE)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    report(result)


def run_collectives(args, work: Path) -> dict:
    out = {}
    for layout in args.layouts.split(","):
        hosts, procs = (int(x) for x in layout.split("x"))
        out[layout] = summarize_collectives(bench_collectives(hosts, procs, args.max_bytes, work))
        out[layout]["hosts"], out[layout]["procs_per_host"] = hosts, procs
    result_top = out.get("2x2", next(iter(out.values())))
    out["hierarchical_link_fraction"] = result_top["hierarchical_link_fraction"]
    return out


def report(result: dict) -> None:
    for layout, s in result.get("collectives", {}).items():
        if not isinstance(s, dict):
            continue
        print(f"{layout}: link busy (hierarchical, >= 16 MiB, worst) {s['hierarchical_link_fraction']:.2f}; "
              f"hierarchical/flat algbw (>= 16 MiB, worst) {s['min_hierarchical_over_flat_16m']:.2f}; "
              f"auto/best (>= 64 KiB, worst) {s['min_auto_over_best_64k']:.3f}")  # fmt: skip
    payoff = result.get("payoff")
    if payoff:
        for name, s in payoff["settings"].items():
            ratio = s["time_to_flat_loss_over_T"]
            print(f"{name}: {s['steps_in_T']} steps in T, final val loss {s['final_val_loss']:.4f}, "
                  f"reaches flat's {payoff['target_val_loss']:.4f} at "
                  f"{'not reached' if ratio is None else f'{ratio:.2f} T'}")  # fmt: skip
        reached = [payoff["settings"][n]["time_to_flat_loss_over_T"] for n in COMPRESSED]
        best = min((r for r in reached if r is not None), default=None)
        print(f"best compressed time-to-loss / T: {'not reached' if best is None else f'{best:.3f}'}")


if __name__ == "__main__":
    main()
