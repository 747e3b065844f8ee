"""Communication-light and asynchronous data parallelism against synchronous DP (issue #16): on
emulated hosts over a slow link, and with one slow rank. Needs root (network namespaces and tc,
``cluster/emulated.py``; cgroup CPU throttling, ``cluster/throttle.py``).

Every run trains the default job's model and data (``configs/shakespeare_char.toml``: 824,448
parameters, global batch 12 of 64 tokens) from the same seed, evaluates the one model it holds
(DiLoCo's θ_global, async's server model) every ``eval_interval`` steps on the same validation
batches, and records validation loss against wall seconds since its launch and against the
bytes a rank sent over the dp group (mean over ranks, the gradient hooks' count).

Part ``link``: world 4 on 2 emulated hosts × 2 processes whose links run at ``LINK_RATE`` each
way, no throttling (micro-batch 3): ``sync`` DP, ``local_sgd`` (H = 8), ``diloco`` (H = 100,
fp32 outer gradients), ``diloco_int8`` (H = 50, int8 outer gradients), ``streaming_diloco``
(H = 100, its default 2 fragments, overlap 1), all for ``steps``; ``diloco_long`` (H = 100 for
3 × the steps, its own schedule: how long DiLoCo takes to reach sync DP's final loss when
it may train past it); ``diloco_warm`` and ``diloco_warm_hosts`` (DiLoCo H = 100 from sync DP's
checkpoint at a quarter of the steps, as Douillard et al. 2023 §3 start DiLoCo and its baseline
from one synchronously pretrained model: 4 replicas of one rank, and 2 replicas of 2 ranks, one
per host, whose inner all-reduces stay inside the host); ``diloco_warm_hier`` (4 replicas of one
rank, the outer all-reduce hierarchical over the hosts: ``data_parallel.comm_hook``); ``async``
(the server and one worker on host 0, two workers on host 1, H = 50). Plus the bytes that crossed
the host links (tc counters).

Part ``throttled``: three training ranks, each limited by the kernel's CFS bandwidth control to
a fraction of one core and pinned (``simulate.rank_speed``), two at ``FAST`` and one at a
quarter of that (``SLOW``); micro-batch 4: ``sync`` (uniform split: every step waits for the
slow rank), ``sync_balanced`` (``balance.data``: the split follows measured speed), ``async``
(4 processes: rank 0 the server at ``SERVER`` of a core, the 3 ranks as workers, H = 50) for the
same tokens, and ``async_long`` for 3 × the tokens.

A warm run's curve continues sync DP's from the checkpoint's step (its time and bytes start
where sync's stood there: the shared pretraining is paid once, by sync); its bytes per step are
its own steps'. Per run: final validation loss, wall seconds, tokens/s, bytes per step, the
wall seconds until its validation loss first reached sync DP's final one (``time_to_sync_loss_s``; sync's own is its
last evaluation's) and, for async, staleness counts. Ratios are against ``sync`` of the same
part and invocation (a shared machine: only ratios from one invocation are comparable). The
JSON's headline figures: ``diloco_val_loss_ratio`` (DiLoCo H = 100's final validation loss over
sync DP's, equal steps) and ``diloco_bytes_ratio`` (sync DP's bytes per step over its); the
same for ``diloco_int8``, ``diloco_warm``, ``diloco_warm_hosts`` and ``diloco_warm_hier``, and
for the three warm runs ``*_link_bytes_ratio`` (sync DP's bytes per step over the host links
over the run's, tc counters); ``sync_loss_time_ratio`` of
the fastest sync-family run to reach sync DP's final loss (link) and of async (throttled), over
sync DP's time. The plot (validation loss against wall time and against bytes) goes to
``docs/img/async_dp.png``.

    python benchmarks/bench_async_dp.py [--part link|throttled|all] [--quick] [--out FILE]

Writes ``benchmarks/results/async_dp.json`` (a part run alone keeps the file's other part;
``--quick``: a smoke test of a few steps, JSON and plot written to the temp directory instead)
and prints a table per part, DiLoCo's bytes ratio last.
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
from collections import Counter
from pathlib import Path

import torch

from loomtrain.cluster.emulated import ClusterSpec, emulated_cluster, missing_requirements
from loomtrain.cluster.throttle import sweep_stale, throttle_requirements
from loomtrain.config import toml_value

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "shakespeare_char.toml"
RESULTS = ROOT / "benchmarks" / "results"
PLOT = ROOT / "docs" / "img" / "async_dp.png"
FAST, SLOW, SERVER = 0.6, 0.15, 0.25  # cores: 0.6 + 0.25 and 0.6 + 0.15, each within 0.9
# diloco_long and async_long train this many times the steps (tokens): long enough to pass sync DP's
# final loss (measured: DiLoCo H = 100 ends 12% above it at equal steps, and at 3x passes it; async
# ends 9% above at equal tokens and still 0.5% above at 2x)
LONG = {"diloco_long": 3, "async_long": 3}
# diloco_warm* start from sync DP's checkpoint at steps // WARM_SHARE: 500 of 2000, as DiLoCo's paper
# starts from a model pretrained for 24k of its 88k steps (Douillard et al. 2023 §3)
WARM_SHARE = 4
COMMON = ["--metrics.progress_bar=false", "--sample.max_new_tokens=0", "--checkpoint.enabled=false",
          "--metrics.tensorboard=false", "--distributed.probe_topology=false"]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LINK_RATE = "100mbit"
SYNC_FAMILY = ("local_sgd", "diloco", "diloco_int8", "streaming_diloco", "diloco_long")
FULL = {"steps": 2000, "eval_interval": 100,
        "inner_steps": {"local_sgd": 8, "diloco": 100, "diloco_int8": 50, "streaming_diloco": 100,
                        "async": 50}}  # fmt: skip
QUICK = {"steps": 20, "eval_interval": 5,
         "inner_steps": {"local_sgd": 2, "diloco": 5, "diloco_int8": 5, "streaming_diloco": 4, "async": 5}}  # fmt: skip


def run_spec(nproc: int, args: list[str], scale: int = 1, resume: str | None = None) -> dict:
    """One run: its process count, CLI arguments (besides the schedule and ``COMMON``), how many
    times the plan's steps it trains, and the run (its directory's name) whose checkpoint at
    :func:`warm_step` it resumes from (``None``: from scratch)."""
    return {"nproc": nproc, "args": args, "scale": scale, "resume": resume}


def warm_step(plan: dict) -> int:
    """The step of sync DP's checkpoint the warm runs start from."""
    return plan["steps"] // WARM_SHARE


def mode(plan: dict, name: str, key: str | None = None) -> list[str]:
    """The arguments of data-parallel mode ``name`` with the plan's H for ``key`` (default ``name``)."""
    return [f"--data_parallel.mode={name}", f"--data_parallel.inner_steps={plan['inner_steps'][key or name]}"]


def link_runs(plan: dict) -> dict[str, dict]:
    """The link part's runs, world 4 on the emulated cluster."""
    micro, workers = "--training.micro_batch_size=3", "--training.micro_batch_size=4"  # 12 over 4 ranks / 3 workers
    diloco = [micro, *mode(plan, "diloco")]
    every = warm_step(plan)
    checkpoints = ["--checkpoint.enabled=true", f"--checkpoint.interval={every}",
                   f"--checkpoint.keep_last={WARM_SHARE + 1}"]  # fmt: skip
    return {
        "sync": run_spec(4, [micro, *checkpoints]),
        "local_sgd": run_spec(4, [micro, *mode(plan, "local_sgd")]),
        "diloco": run_spec(4, diloco),
        "diloco_int8": run_spec(
            4, [micro, *mode(plan, "diloco", "diloco_int8"), "--data_parallel.outer_grad_dtype=int8"]
        ),
        "streaming_diloco": run_spec(4, [micro, *mode(plan, "streaming_diloco")]),
        "diloco_long": run_spec(4, diloco, scale=LONG["diloco_long"]),
        "diloco_warm": run_spec(4, diloco, resume="link_sync"),
        "diloco_warm_hosts": run_spec(4, [*diloco, "--parallel.data_parallel_replicate_degree=2"], resume="link_sync"),
        "diloco_warm_hier": run_spec(4, [*diloco, "--data_parallel.comm_hook=hierarchical"], resume="link_sync"),
        "async": run_spec(4, [workers, *mode(plan, "async")]),
    }


def throttled_runs(plan: dict) -> dict[str, dict]:
    """The throttled part's runs: 3 training ranks at ``FAST``, ``FAST``, ``SLOW`` of a core."""
    micro = "--training.micro_batch_size=4"  # 12 over 3 ranks or 3 workers
    three = f"--simulate.rank_speed={toml_value([FAST, FAST, SLOW])}"
    four = f"--simulate.rank_speed={toml_value([SERVER, FAST, FAST, SLOW])}"
    async_ = [micro, four, *mode(plan, "async")]
    return {
        "sync": run_spec(3, [micro, three]),
        "sync_balanced": run_spec(3, [micro, three, "--balance.data=true"]),
        "async": run_spec(4, async_),
        "async_long": run_spec(4, async_, scale=LONG["async_long"]),
    }


def schedule(plan: dict, scale: int) -> list[str]:
    """Steps, warm-up (the default job's 1/20) and evaluation cadence of a run of ``scale`` × the plan's steps."""
    steps, every = plan["steps"] * scale, plan["eval_interval"]
    return [f"--training.steps={steps}", f"--training.warmup_steps={plan['steps'] // 20}",
            f"--training.eval_interval={every}", f"--training.log_interval={every}"]  # fmt: skip


def train(work: Path, name: str, spec: dict, plan: dict, cluster: str | None = None) -> tuple[Path, float, float]:
    """One ``loomtrain train`` run as a subprocess (local processes, or on the emulated
    ``cluster``); returns its run directory, its launch time (Unix seconds) and wall seconds.

    Raises:
        RuntimeError: the run failed; the message holds the command and the end of its stderr.
    """
    where = ["--nproc", str(spec["nproc"])] if cluster is None else ["--cluster", cluster]
    start_from = ["--overwrite"]  # a resumed run writes a fresh directory; --overwrite would contradict it
    if spec.get("resume"):
        start_from = [f"--checkpoint.resume={work / spec['resume'] / 'checkpoints' / f'step_{warm_step(plan):08d}'}"]
    cmd = [sys.executable, "-m", "loomtrain.cli", "train", "--config", str(CONFIG), *where,
           f"--run.out_dir={work}", f"--run.name={name}", *start_from, *COMMON,
           *schedule(plan, spec["scale"]), *spec["args"]]  # fmt: skip
    env = ENV if cluster is None else {**ENV, "LOOMTRAIN_CLUSTER_DIR": str(work / "clusters")}
    launched, start = time.time(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\nexited {proc.returncode}:\n{proc.stderr[-4000:]}")
    wall = time.perf_counter() - start
    print(f"  {name}: {wall:.0f} s", flush=True)
    return work / name, launched, wall


def curve(records: list[dict], launched: float, summary: dict, wall_s: float) -> list[list[float]]:
    """``[step, seconds since launch, bytes sent per rank so far, validation loss]`` at every
    evaluation, the final one included (async's final evaluation is not in ``metrics.jsonl``: its
    time is the process's end). Bytes: ``comm_bytes_dp`` (the mean over ranks per step so far)
    × steps; async records carry none, so its run mean is used. ``records``: ``metrics.jsonl``'s."""
    per_step = summary["comm_bytes_per_step"]
    points = [[r["step"], r["time"] - launched, r.get("comm_bytes_dp", per_step) * r["step"], r["val_loss"]]
              for r in records if "val_loss" in r]  # fmt: skip
    final = summary["final_step"]
    if not points or points[-1][0] < final:
        points.append([final, wall_s, per_step * final, summary["val_loss"]])
    return points


def summarize(run: Path, launched: float, wall_s: float) -> dict:
    """One run's figures from its ``summary.json`` and ``metrics.jsonl``."""
    s = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out = {"val_loss": s["val_loss"], "steps": s["final_step"], "tokens_per_s": s["tokens_per_s"],
           "train_wall_s": s["wall_s"], "process_wall_s": wall_s, "comm_bytes_per_step": s["comm_bytes_per_step"],
           "curve": curve(records, launched, s, wall_s)}  # fmt: skip
    if "staleness_applied" in s:
        rounds = dict(Counter(str(r["worker"]) for r in records if "worker" in r))
        out.update({"staleness_applied": s["staleness_applied"], "staleness_rejected": s["staleness_rejected"],
                    "outer_steps": s["outer_steps"], "rounds_per_worker": rounds})  # fmt: skip
    return out


def time_to(points: list[list[float]], target: float) -> float | None:
    """Seconds since launch of the first evaluation at or below ``target``; None if never."""
    return next((t for _, t, _, loss in points if loss <= target), None)


def with_ratios(result: dict) -> dict:
    """``result`` (name → figures) with each run's figures against ``sync``'s: tokens/s, final
    validation loss, bytes (sync's over this run's) and the seconds until sync's final
    validation loss was reached (``time_to_sync_loss_s``, None if never, and its ratio)."""
    sync = result["sync"]
    target = sync["val_loss"]
    sync_time = time_to(sync["curve"], target)
    for r in result.values():
        r["tokens_per_s_vs_sync"] = r["tokens_per_s"] / sync["tokens_per_s"]
        r["val_loss_vs_sync"] = r["val_loss"] / target
        r["bytes_ratio_sync_over_this"] = sync["comm_bytes_per_step"] / max(r["comm_bytes_per_step"], 1.0)
        if "link_bytes_per_step" in r:
            r["link_bytes_ratio_sync_over_this"] = sync["link_bytes_per_step"] / max(r["link_bytes_per_step"], 1.0)
        r["time_to_sync_loss_s"] = time_to(r["curve"], target)
        reached = r["time_to_sync_loss_s"]
        r["time_to_sync_loss_vs_sync"] = None if reached is None else reached / sync_time
    return result


def measure_link(plan: dict, work: Path) -> dict:
    """Part ``link``: every run of :func:`link_runs` on 2 emulated hosts × 2 processes, with the
    bytes that crossed the host links per step (both directions of both links, tc counters)."""
    spec = ClusterSpec(hosts=2, procs_per_host=2, inter_rate=LINK_RATE, name="bad")
    result = {}
    with emulated_cluster(spec, state_dir=work / "clusters") as cluster:
        for name, run in link_runs(plan).items():
            before = sum(sum(cluster.link_bytes(h)) for h in range(2))
            figures = summarize(*train(work, f"link_{name}", run, plan, cluster=spec.name))
            crossed = sum(sum(cluster.link_bytes(h)) for h in range(2)) - before
            start = warm_step(plan) if run["resume"] else 0
            if start:
                joined = continue_curve(figures["curve"], result["sync"], start)
                figures = {**figures, "warm_start_step": start, "curve": joined}
            result[name] = {**figures, "link_bytes_per_step": crossed / (figures["steps"] - start)}
    return {"hosts": 2, "procs_per_host": 2, "inter_rate": LINK_RATE, "steps": plan["steps"],
            "configs": link_runs(plan), "runs": with_ratios(result)}  # fmt: skip


def continue_curve(points: list[list[float]], base: dict, step: int) -> list[list[float]]:
    """A warm run's curve ``points`` (seconds since its own launch; bytes as :func:`curve` counts
    them, its own steps' rate × the step) as the continuation of ``base``'s (sync DP's figures)
    from ``step``: base's time and bytes at that step added to its own since, base's points up
    to it in front.

    Raises:
        ValueError: ``base`` has no evaluation at ``step``.
    """
    before = [p for p in base["curve"] if p[0] <= step]
    if not before or before[-1][0] != step:
        raise ValueError(f"sync DP's curve has no evaluation at the warm start's step {step}")
    _, seconds, sent, _ = before[-1]
    return before + [[s, t + seconds, sent + b * (s - step) / s, loss] for s, t, b, loss in points if s > step]


def measure_throttled(plan: dict, work: Path) -> dict:
    """Part ``throttled``: every run of :func:`throttled_runs`, with ratios against ``sync``."""
    try:
        result = {name: summarize(*train(work, name, run, plan)) for name, run in throttled_runs(plan).items()}
    finally:
        sweep_stale()  # a run killed while throttled leaves its cgroup behind
    return {"rank_speeds": {"fast": FAST, "slow": SLOW, "server": SERVER}, "steps": plan["steps"],
            "configs": throttled_runs(plan), "runs": with_ratios(result)}  # fmt: skip


def fastest_to_sync_loss(runs_: dict, names: tuple[str, ...]) -> tuple[str | None, float | None]:
    """Of ``names``, the run that reached sync DP's final loss soonest and its time over sync's."""
    reached = [
        (r["time_to_sync_loss_vs_sync"], n) for n, r in runs_.items() if n in names and r["time_to_sync_loss_vs_sync"]
    ]
    return (min(reached)[1], min(reached)[0]) if reached else (None, None)


def headline(result: dict) -> dict:
    """Issue #16's figures: ``diloco_val_loss_ratio`` (DiLoCo's final validation loss over sync
    DP's, equal steps, link part), ``diloco_bytes_ratio`` (sync DP's bytes per step over
    DiLoCo's), the same for 8-bit DiLoCo, and the time ratios to sync DP's final loss: the
    fastest sync-family run over the link, async (equal or 3× the tokens) with the slow rank."""
    out = {}
    if "link" in result:
        link = result["link"]["runs"]
        for name in ("diloco", "diloco_int8", "diloco_warm", "diloco_warm_hosts", "diloco_warm_hier"):
            out[f"{name}_val_loss_ratio"] = link[name]["val_loss_vs_sync"]
            out[f"{name}_bytes_ratio"] = link[name]["bytes_ratio_sync_over_this"]
        for name in ("diloco_warm", "diloco_warm_hosts", "diloco_warm_hier"):
            out[f"{name}_link_bytes_ratio"] = link[name]["link_bytes_ratio_sync_over_this"]
        out["link_fastest_to_sync_loss"], out["link_sync_loss_time_ratio"] = fastest_to_sync_loss(link, SYNC_FAMILY)
    if "throttled" in result:
        runs_ = result["throttled"]["runs"]
        out["throttled_async_to_sync_loss"], out["throttled_async_sync_loss_time_ratio"] = fastest_to_sync_loss(
            runs_, ("async", "async_long")
        )
        out["throttled_balanced_sync_loss_time_ratio"] = runs_["sync_balanced"]["time_to_sync_loss_vs_sync"]
    return out


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    return {"cpu": model, "cpu_count": os.cpu_count(), "kernel": platform.release(), "torch": torch.__version__,
            "python": platform.python_version(), "load_average_at_start": os.getloadavg()}  # fmt: skip


def plot(result: dict, path: Path) -> None:
    """Validation loss against wall seconds (each part) and against bytes per rank (link), sync
    DP's final loss dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(p, x) for p, xs in (("link", (1, 2)), ("throttled", (1,))) if p in result for x in xs]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (part, x) in zip(axes[0], panels, strict=True):
        runs_ = result[part]["runs"]
        for name, r in runs_.items():
            points = [p for p in r["curve"] if x == 1 or p[2] > 0]  # log axis: no zero bytes
            ax.plot([p[x] for p in points], [p[3] for p in points], marker=".", label=name)
        ax.axhline(runs_["sync"]["val_loss"], color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel("validation loss (nats/token)")
        if x == 2:
            ax.set_xscale("log")
        ax.set_xlabel("bytes sent per rank over dp" if x == 2 else "wall seconds since launch")
        where = f"{LINK_RATE} link, 2 hosts × 2" if part == "link" else f"ranks at {FAST}, {FAST}, {SLOW} of a core"
        ax.set_title(f"{part}: {where}", fontsize=9)
        ax.set_ylim(top=min(1.4 * runs_["sync"]["val_loss"], ax.get_ylim()[1]))  # the early, high losses cut
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def print_table(part: str, result: dict) -> None:
    print(f"{part}:\n{'run':<17} {'val loss':>8} {'vs sync':>7} {'to sync loss s':>14} {'vs sync':>7} "
          f"{'tokens/s':>9} {'bytes/step':>11} {'sync/this':>9} {'link sync/this':>14}")  # fmt: skip
    for name, r in result["runs"].items():
        reached, ratio = r["time_to_sync_loss_s"], r["time_to_sync_loss_vs_sync"]
        link = r.get("link_bytes_ratio_sync_over_this")  # the link part only
        print(f"{name:<17} {r['val_loss']:>8.4f} {r['val_loss_vs_sync']:>7.3f} "
              f"{'never' if reached is None else f'{reached:.0f}':>14} {'-' if ratio is None else f'{ratio:.3f}':>7} "
              f"{r['tokens_per_s']:>9.0f} {r['comm_bytes_per_step']:>11.0f} "
              f"{r['bytes_ratio_sync_over_this']:>9.1f} {'-' if link is None else f'{link:.1f}':>14}")  # fmt: skip
    for name, r in result["runs"].items():
        if "rounds_per_worker" in r:
            print(f"{name}: rounds per worker {r['rounds_per_worker']}, staleness applied {r['staleness_applied']}, "
                  f"rejected {r['staleness_rejected']}")  # fmt: skip


def print_headline(figures: dict) -> None:
    """The headline figures, DiLoCo's bytes ratio last."""
    for key in ("throttled_async_sync_loss_time_ratio", "throttled_balanced_sync_loss_time_ratio",
                "link_sync_loss_time_ratio", "diloco_int8_val_loss_ratio", "diloco_int8_bytes_ratio",
                "diloco_warm_hier_val_loss_ratio", "diloco_warm_hier_link_bytes_ratio",
                "diloco_warm_hosts_val_loss_ratio", "diloco_warm_hosts_link_bytes_ratio", "diloco_warm_val_loss_ratio",
                "diloco_warm_link_bytes_ratio", "diloco_warm_bytes_ratio", "diloco_val_loss_ratio",
                "diloco_bytes_ratio"):  # fmt: skip
        if key in figures:
            value = figures[key]
            print(f"{key}: {'not reached' if value is None else f'{value:.3f}'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["link", "throttled", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="a few steps each: a smoke test, not a measurement")
    parser.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/async_dp.json)")
    args = parser.parse_args()
    parts = ["link", "throttled"] if args.part == "all" else [args.part]
    for reason in (throttle_requirements() if "throttled" in parts else None,
                   missing_requirements() if "link" in parts else None):  # fmt: skip
        if reason is not None:
            sys.exit(f"error: {reason}")
    plan = QUICK if args.quick else FULL
    out = args.out or (Path(tempfile.gettempdir()) if args.quick else RESULTS) / "async_dp.json"
    kept = json.loads(out.read_text()) if out.exists() else {}
    result = {part: kept[part] for part in ("link", "throttled") if part in kept and kept.get("plan") == plan}
    result.update({"config": str(CONFIG.relative_to(ROOT)), "common": COMMON, "plan": plan})
    work = Path(tempfile.mkdtemp(prefix="bench_async_dp_"))
    try:
        for part in parts:
            start, host = time.perf_counter(), machine()
            date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            measured = measure_link(plan, work) if part == "link" else measure_throttled(plan, work)
            result[part] = {"machine": host, "date": date, "wall_s": time.perf_counter() - start, **measured}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.update(headline(result))
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png") if args.quick else PLOT)
    print(f"wrote {out}")
    for part in ("link", "throttled"):
        if part in result:
            print_table(part, result[part])
    print_headline(result)


if __name__ == "__main__":
    main()
