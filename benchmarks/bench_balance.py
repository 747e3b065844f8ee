"""Heterogeneous load balancing (issue #15): what balancing buys on ranks of unequal speed, and
how close it comes to the best the devices allow. Needs root (cgroup CPU throttling).

Slow devices are real: each rank's process is limited by the kernel's CFS bandwidth control to
a fraction of one core and pinned (``simulate.rank_speed``, ``cluster/throttle.py``), with at
most 0.9 of a core per core, so no rank waits for another rank's time slice.

Part ``dp``: world 4 at 0.72 : 0.54 : 0.36 : 0.18 of a core (cores: 0.72 + 0.18 and 0.54 +
0.36), global batch 120 (so 48 : 36 : 24 : 12 follows the speeds exactly), the default job's
model widened (``DP_MODEL``) so compute dominates the gradient all-reduce. The uniform split
(``balance.samples_per_rank=[30, 30, 30, 30]``: the same code path as balancing, the split
fixed) and ``balance.data=true`` run alternately, ``rounds`` times each (order reversed every
round), and the median of their steady-state tokens/s is reported. Steady state: the logged
windows of ``metrics.jsonl`` after the first ``dp_skip`` steps (warm-up and the balancer's
first decisions), total tokens over total seconds. The ideal is the sum of the ranks' solo
rates: rank ``r``'s rate is that of one process alone on the machine at the same quota doing
the same work per step that rank does in the balanced run (a global batch of its settled
share, one micro-batch, its own optimizer step), so ideal tokens/s = Σ_r share_r · seq_len /
solo step seconds_r: the balanced run with zero waiting and zero communication.

Part ``change``: the balanced run again, rank 0 slowed from 0.72 to 0.36 before step
``change_at`` (``simulate.speed_change``). Reported: tokens/s before and after, the new ideal
(solo rates at the new quotas with the shares the run settles on), and how many rebalances
after the change pass before a logged window is within 10 % of the new ideal. The plot
``balance_speed_change.png`` shows per-rank samples per step (``balance.jsonl``) and tokens/s
per window (``metrics.jsonl``) against the step.

Part ``pipeline``: pp 2 (one rank per core) at 0.8 and 0.4 of a core, 16 layers, 16
micro-batches per step (1F1B). The equal split (8 : 8 layers) against
``balance.pipeline=true``, steady-state tokens/s (the balanced run's from the logged window
after the one holding its first layer move's rebuild on, any later moves included). The ideal
is the step time ``stage_balance.predicted_step_s`` gives for the partition ``stage_balance.balanced_stages``
finds (fill and drain included, communication and the optimizer step not), from per-layer
seconds measured alone under each quota: one throttled process per quota times a
transformer block's forward plus backward on one micro-batch, sustained over ``probe_s``
seconds (a single call is shorter than the 10 ms CFS period, so its time would show full
speed or a stall by chance), and likewise the embedding and the head with the loss, which
enter the partition as the first and last items. Per-layer times derived from the uniform
run's ``timeline.json`` (what the balancer sees) are reported next to them.

Targets: balanced >= 0.9 × ideal (dp and pipeline); balanced >= 1.3 × the equal split (both);
after the slowdown, a window within 10 % of the new ideal within 3 rebalances.

    python benchmarks/bench_balance.py [--part dp|pipeline|change|all] [--quick] [--out FILE]

Writes ``benchmarks/results/balance.json`` and ``benchmarks/results/balance_speed_change.png``
(``--quick``: a smoke test of a few steps each, written to the work directory instead); prints
a table with the dp balanced / ideal ratio last. Runs one training process group at a time, on
an otherwise idle machine; glibc keeps freed memory (see ``bench_pipeline.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loomtrain.cluster.throttle import CpuThrottle, plan_cores, throttle_requirements
from loomtrain.config import ModelConfig, load_config, toml_value
from loomtrain.data.tokenizer import load_tokenizer
from loomtrain.distributed.pipeline import stage_balance
from loomtrain.models import Transformer

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "shakespeare_char.toml"
RESULTS = ROOT / "benchmarks" / "results"
RANK_SPEEDS = [0.72, 0.54, 0.36, 0.18]
SLOWED = 0.36  # rank 0's speed after the change; its core then holds 0.36 + 0.18 <= 0.9
GLOBAL_BATCH = 120
PP_SPEEDS = [0.8, 0.4]
PP_MICRO, PP_N_MICRO = 2, 16  # samples per micro-batch, micro-batches per step
WITHIN = 0.9  # "within 10 % of the ideal"
TARGETS = {"balanced_over_ideal": 0.9, "balanced_over_uniform": 1.3, "rebalances_to_recover": 3}
COMMON = ["--metrics.progress_bar=false", "--sample.max_new_tokens=0", "--checkpoint.enabled=false",
          "--checkpoint.interval=1000000", "--metrics.tensorboard=false", "--training.eval_batches=2"]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36)}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Sizes of one pass: models (config overrides), steps per run, steps left out as warm-up,
    the balance and logging interval, alternating dp rounds, seconds per sustained probe."""

    dp_model: tuple[str, ...]
    dp_steps: int
    dp_skip: int
    rounds: int
    solo_steps: int
    solo_skip: int
    change_steps: int
    change_at: int  # 1 more than a multiple of interval: the change starts a logged window
    pp_model: tuple[str, ...]
    pp_steps: int  # not a multiple of interval: a layer move on the last step leaves no step to time
    pp_skip: int
    interval: int
    probe_s: float


DP_MODEL = ("--model.dim=256", "--model.n_layers=4", "--model.n_heads=8", "--model.max_seq_len=64",
            "--training.seq_len=64")  # fmt: skip
PP_MODEL = ("--model.dim=128", "--model.n_layers=16", "--model.n_heads=4", "--model.max_seq_len=64",
            "--training.seq_len=64")  # fmt: skip
FULL = Plan(DP_MODEL, 40, 15, 2, 15, 5, 70, 36, PP_MODEL, 37, 5, 5, 3.0)
QUICK = Plan(("--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.max_seq_len=32",
              "--training.seq_len=32"), 8, 4, 1, 4, 2, 12, 7, ("--model.dim=32", "--model.n_layers=16",
              "--model.n_heads=4", "--model.max_seq_len=32", "--training.seq_len=32"), 9, 2, 2, 0.3)  # fmt: skip


# ---- running the CLI and reading its files ----


def train(work: Path, name: str, nproc: int, extra: list[str]) -> Path:
    """One ``loomtrain train`` run as a subprocess; returns its run directory.

    Raises:
        RuntimeError: the run failed; the message holds the command and the end of its stderr.
    """
    cmd = [sys.executable, "-m", "loomtrain.cli", "train", "--config", str(CONFIG), "--nproc", str(nproc),
           f"--run.out_dir={work}", f"--run.name={name}", "--overwrite", *COMMON, *extra]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\nexited {proc.returncode}:\n{proc.stderr[-4000:]}")
    print(f"  {name}: {time.perf_counter() - start:.0f} s", flush=True)
    return work / name


def jsonl(run: Path, name: str) -> list[dict]:
    path = run / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in jsonl(run, "events.jsonl") if e["event"] == kind]


def windows(run: Path) -> list[tuple[int, int, float]]:
    """``(first step, last step, tokens/s)`` of every ``metrics.jsonl`` record: the record's
    tokens/s covers the steps since the previous record."""
    out, previous = [], 0
    for record in jsonl(run, "metrics.jsonl"):
        out.append((previous + 1, record["step"], record["tokens_per_s"]))
        previous = record["step"]
    return out


def steady_tokens_per_s(run: Path, after: int, until: int | None = None) -> float:
    """Tokens/s over the logged windows that start after step ``after`` and end by ``until``:
    all their tokens over all their seconds (windows weighted by their steps).

    Raises:
        ValueError: no window in that range (a run too short for its warm-up).
    """
    chosen = [(last - first + 1, rate) for first, last, rate in windows(run)
              if first > after and (until is None or last <= until)]  # fmt: skip
    if not chosen:
        raise ValueError(f"{run}: no logged window between step {after} and {until}; run more steps")
    return sum(n for n, _ in chosen) / sum(n / rate for n, rate in chosen)


def final_split(run: Path) -> list[int]:
    return jsonl(run, "balance.jsonl")[-1]["samples"]


# ---- data parallel ----


def dp_args(plan: Plan, steps: int, balanced: bool) -> list[str]:
    """The dp job: 4 throttled ranks, global batch 120 in one micro-batch per rank."""
    split = ["--balance.data=true"] if balanced else [f"--balance.samples_per_rank={toml_value([30] * 4)}"]
    return [*plan.dp_model, f"--training.global_batch_size={GLOBAL_BATCH}", "--training.micro_batch_size=30",
            f"--simulate.rank_speed={toml_value(RANK_SPEEDS)}", f"--balance.interval={plan.interval}",
            f"--training.log_interval={plan.interval}", f"--training.steps={steps}",
            f"--training.eval_interval={steps}", *split]  # fmt: skip


def dp_run_summary(run: Path, skip: int) -> dict:
    """A dp run's steady tokens/s, its splits over time, rebalances and last per-rank figures."""
    checks = jsonl(run, "balance.jsonl")
    return {
        "tokens_per_s": steady_tokens_per_s(run, skip),
        "final_split": checks[-1]["samples"],
        "splits": [[c["step"], c["samples"]] for c in checks],
        "rebalances": len(events(run, "rebalance")),
        "windows": windows(run),
        "compute_tokens_per_s_per_rank": checks[-1]["tokens_per_s"],
        "wait_s_per_rank": checks[-1]["wait_s"],
    }


class SoloRates:
    """Solo rates, measured once per (speed, share): one process throttled to ``speed`` of a
    core training a global batch of ``share`` samples in one micro-batch."""

    def __init__(self, work: Path, plan: Plan):
        self.work, self.plan, self.rates = work, plan, {}

    def tokens_per_s(self, speed: float, share: int) -> float:
        if (speed, share) not in self.rates:
            p = self.plan
            run = train(self.work, f"solo_{speed}_{share}", 1, [
                *p.dp_model, f"--training.global_batch_size={share}", f"--training.micro_batch_size={share}",
                f"--simulate.rank_speed=[{speed}]", f"--training.steps={p.solo_steps}",
                f"--training.eval_interval={p.solo_steps}", f"--training.log_interval={p.interval}"])  # fmt: skip
            self.rates[(speed, share)] = steady_tokens_per_s(run, p.solo_skip)
        return self.rates[(speed, share)]

    def ideal(self, speeds: list[float], split: list[int]) -> dict:
        """The sum of the ranks' solo tokens/s at ``speeds`` with shares ``split``."""
        solo = [self.tokens_per_s(s, n) for s, n in zip(speeds, split, strict=True)]
        return {"speeds": speeds, "split": split, "solo_tokens_per_s": solo, "tokens_per_s": sum(solo)}

    def table(self) -> list[dict]:
        return [{"speed": s, "share": n, "tokens_per_s": r} for (s, n), r in sorted(self.rates.items())]


def measure_dp(work: Path, plan: Plan, solo: SoloRates) -> dict:
    """Uniform and balanced runs alternated over ``plan.rounds``; the ideal from solo rates."""
    runs: dict[str, list[dict]] = {"uniform": [], "balanced": []}
    for r in range(plan.rounds):
        for kind in ("uniform", "balanced") if r % 2 == 0 else ("balanced", "uniform"):
            run = train(work, f"dp_{kind}_{r}", 4, dp_args(plan, plan.dp_steps, kind == "balanced"))
            runs[kind].append(dp_run_summary(run, plan.dp_skip))
    finals = Counter(tuple(b["final_split"]) for b in runs["balanced"])
    split = list(finals.most_common(1)[0][0])
    ideal = solo.ideal(RANK_SPEEDS, split)
    uniform = statistics.median(u["tokens_per_s"] for u in runs["uniform"])
    balanced = statistics.median(b["tokens_per_s"] for b in runs["balanced"])
    return {
        "runs": runs, "settled_split": split, "uniform_tokens_per_s": uniform, "balanced_tokens_per_s": balanced,
        "ideal": ideal, "balanced_over_ideal": balanced / ideal["tokens_per_s"],
        "balanced_over_uniform": balanced / uniform, "uniform_over_ideal": uniform / ideal["tokens_per_s"],
    }  # fmt: skip


# ---- a mid-run slowdown ----


def recovery(run: Path, change_at: int, new_ideal: float) -> dict:
    """The first logged window after the change within 10 % of ``new_ideal``, and the
    rebalances after the change that came before it (a rebalance at step s acts from s + 1)."""
    moves = [e["step"] for e in events(run, "rebalance") if e["step"] >= change_at]
    for first, last, rate in windows(run):
        if first >= change_at and rate >= WITHIN * new_ideal:
            return {"window": [first, last], "tokens_per_s": rate, "rebalances_needed": sum(s < first for s in moves),
                    "rebalance_steps": moves}  # fmt: skip
    return {"window": None, "tokens_per_s": None, "rebalances_needed": None, "rebalance_steps": moves}


def measure_change(work: Path, plan: Plan, solo: SoloRates, old_ideal: dict | None) -> dict:
    """The balanced dp run with rank 0 slowed to ``SLOWED`` before ``plan.change_at``."""
    change = f"{plan.change_at}:0:{SLOWED}"
    run = train(work, "change", 4, [*dp_args(plan, plan.change_steps, True),
                                    f"--simulate.speed_change={toml_value([change])}"])  # fmt: skip
    new_speeds = [SLOWED, *RANK_SPEEDS[1:]]
    settled_from = plan.change_at - 1 + plan.dp_skip  # the same settling allowance as after the start
    new_ideal = solo.ideal(new_speeds, final_split(run))
    result = {
        "speed_change": change, "run": dp_run_summary(run, settled_from),
        "before_tokens_per_s": steady_tokens_per_s(run, plan.dp_skip, plan.change_at - 1),
        "after_tokens_per_s": steady_tokens_per_s(run, settled_from),
        "after_measured_from_step": settled_from + 1, "new_ideal": new_ideal,
        "recovery": recovery(run, plan.change_at, new_ideal["tokens_per_s"]),
    }  # fmt: skip
    result["after_over_new_ideal"] = result["after_tokens_per_s"] / new_ideal["tokens_per_s"]
    if old_ideal is not None:
        result["before_over_ideal"] = result["before_tokens_per_s"] / old_ideal["tokens_per_s"]
    result["plot_source"] = str(run)
    return result


def plot_change(run: Path, change_at: int, ideals: tuple[float | None, float], path: Path) -> None:
    """Per-rank samples per step and tokens/s per logged window against the step, the change marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6.5))
    checks = [{"step": 0, "samples": [GLOBAL_BATCH // 4] * 4}, *jsonl(run, "balance.jsonl")]
    steps = [c["step"] for c in checks]
    speeds = [f"{RANK_SPEEDS[0]} → {SLOWED}", *map(str, RANK_SPEEDS[1:])]
    for r in range(4):  # a split decided at step s holds from step s + 1
        top.step(steps, [c["samples"][r] for c in checks], where="post", label=f"rank {r} ({speeds[r]} of a core)")
    top.set_ylabel("samples per step")
    top.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    shown = [w for w in windows(run) if w[1] > 1]  # step 1 alone builds lazily
    xs, ys = [shown[0][0] - 1] + [w[1] for w in shown], [shown[0][2]] + [w[2] for w in shown]
    bottom.step(xs, ys, where="pre", label="measured (per logged window)")
    old, new = ideals
    if old is not None:
        bottom.hlines(old, 0, change_at - 1, colors="grey", linestyles="--", label="ideal (sum of solo rates)")
    bottom.hlines(new, change_at - 1, steps[-1], colors="grey", linestyles="--")
    bottom.hlines(WITHIN * new, change_at - 1, steps[-1], colors="grey", linestyles=":", label="0.9 × new ideal")
    bottom.set_ylabel("tokens/s (global)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    for ax in (top, bottom):
        ax.axvline(change_at - 0.5, color="red", linewidth=1)
    top.set_title(f"rank 0 slowed from {RANK_SPEEDS[0]} to {SLOWED} of a core before step {change_at}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ---- pipeline ----


def pp_args(plan: Plan, balanced: bool) -> list[str]:
    """The pp job: 2 ranks at 0.8 and 0.4 of a core, 16 micro-batches per step; balanced moves layers."""
    steps = plan.pp_steps
    balance = ["--balance.pipeline=true", f"--balance.interval={plan.interval}"] if balanced else []
    return [*plan.pp_model, "--parallel.pipeline_parallel_degree=2", f"--training.micro_batch_size={PP_MICRO}",
            f"--training.global_batch_size={PP_MICRO * PP_N_MICRO}", f"--simulate.rank_speed={toml_value(PP_SPEEDS)}",
            f"--training.steps={steps}", f"--training.eval_interval={steps}",
            f"--training.log_interval={plan.interval}", *balance]  # fmt: skip


def timeline_layer_s(run: Path, layers: list[int]) -> list[float]:
    """Per pp rank, its forward plus backward seconds per layer and micro-batch in the run's
    last step (``timeline.json``), embedding and head folded into the first and last rank's."""
    step = json.loads((run / "timeline.json").read_text())["steps"][-1]
    busy = [sum(e["end"] - e["start"] for e in rank["events"]) for rank in step["ranks"]]
    return [s / (n * PP_N_MICRO) for s, n in zip(busy, layers, strict=True)]


def pp_run_summary(run: Path, after: int, layers: list[int]) -> dict:
    """Steady tokens/s and step seconds of a pp run from step ``after`` on, its bubble and moves."""
    seq_len = load_config(run / "config.toml").training.seq_len
    rate = steady_tokens_per_s(run, after)
    bubbles = [r["bubble_fraction"] for r in jsonl(run, "metrics.jsonl") if r["step"] > after]
    return {
        "tokens_per_s": rate, "step_s": PP_MICRO * PP_N_MICRO * seq_len / rate, "measured_after_step": after,
        "bubble_fraction": statistics.mean(bubbles), "layers_per_rank": layers,
        "moves": [[m["step"], m["before"], m["after"]] for m in events(run, "pipeline_rebalance")],
        "timeline_layer_s": timeline_layer_s(run, layers), "windows": windows(run),
    }  # fmt: skip


def _sustained_s(fn, seconds: float) -> float:
    """Mean wall seconds of ``fn()`` called back to back for at least ``seconds`` (after one warm-up)."""
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


def _probe(model_cfg: dict, seq_len: int, speed: float, core: int, seconds: float) -> dict[str, float]:
    """In a fresh process throttled to ``speed`` of ``core``: forward plus backward seconds per
    micro-batch (``PP_MICRO × seq_len`` tokens) of the embedding, of one block (all blocks in
    turn, per block) and of the final norm, head and cross-entropy loss."""
    torch.set_num_threads(1)
    with CpuThrottle(os.getpid(), speed, core, tag=f"bench-balance-probe-{os.getpid()}"):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**model_cfg))
        tokens = torch.randint(model.cfg.vocab_size, (PP_MICRO, seq_len + 1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        cos, sin = model.rope_cos[:seq_len], model.rope_sin[:seq_len]
        h = model.tok_embeddings(x).detach().requires_grad_(True)
        layers = list(model.layers.values())

        def blocks() -> None:
            for layer in layers:
                layer(h, cos, sin).sum().backward()

        def head() -> None:
            F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), y.flatten()).backward()

        return {
            "embedding_s": _sustained_s(lambda: model.tok_embeddings(x).sum().backward(), seconds / 3),
            "block_s": _sustained_s(blocks, seconds) / len(layers),
            "head_s": _sustained_s(head, seconds / 3),
        }


def probe_layer_seconds(run: Path, seconds: float) -> list[dict[str, float]]:
    """``_probe`` of ``run``'s model under each of ``PP_SPEEDS`` on the core that rank ran on,
    one fresh process at a time."""
    cfg = load_config(run / "config.toml")
    model = cfg.model.model_dump()
    model["vocab_size"] = model["vocab_size"] or load_tokenizer(run / "tokenizer").vocab_size
    cores = plan_cores(PP_SPEEDS, os.cpu_count() or 1)
    probes = []
    for speed, core in zip(PP_SPEEDS, cores, strict=True):
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            probes.append(pool.submit(_probe, model, cfg.training.seq_len, speed, core, seconds).result())
    return probes


def _items(boundary: int, n_layers: int) -> list[list[int]]:
    """The two stages as items (0: embedding, 1..n_layers: blocks, n_layers + 1: head) for
    layers ``0..boundary-1`` on pp rank 0."""
    return [list(range(boundary + 1)), list(range(boundary + 1, n_layers + 2))]


def ideal_pipeline(probes: list[dict[str, float]], n_layers: int, balanced_boundary: int) -> dict:
    """The best partition and its predicted step seconds (``stage_balance``), from the probes.

    Cost units are seconds per step on pp rank 0's device (its probe × micro-batches); rank 1's
    speed is rank 0's block time over its own. Also predicted: the equal split and the split
    the balancer ended on.

    Raises:
        ValueError: the best partition leaves a rank without a block (then pp 2 is pointless).
    """
    fast, slow = probes
    per_micro = [fast["embedding_s"], *[fast["block_s"]] * n_layers, fast["head_s"]]
    costs = [PP_N_MICRO * c for c in per_micro]
    speeds = [1.0, fast["block_s"] / slow["block_s"]]
    best = stage_balance.balanced_stages(costs, speeds, 2, 1)
    if min(len(best[0]), len(best[1])) < 2:
        raise ValueError(f"best partition {best} leaves a pp rank without a transformer block")

    def predict(stages: list[list[int]]) -> float:
        return stage_balance.predicted_step_s(stages, costs, speeds, PP_N_MICRO, 2, 1)

    return {
        "probes": probes, "speeds": speeds, "layers_per_rank": [len(best[0]) - 1, len(best[1]) - 1],
        "step_s": predict(best), "equal_split_step_s": predict(_items(n_layers // 2, n_layers)),
        "balancer_split_step_s": predict(_items(balanced_boundary, n_layers)),
    }  # fmt: skip


def measure_pipeline(work: Path, plan: Plan) -> dict:
    """The equal split and ``balance.pipeline=true``; the ideal from probes under each quota."""
    uniform = train(work, "pp_uniform", 2, pp_args(plan, False))
    balanced = train(work, "pp_balanced", 2, pp_args(plan, True))
    n_layers = load_config(uniform / "config.toml").model.n_layers
    moves = events(balanced, "pipeline_rebalance")
    boundary = moves[-1]["after"][0] if moves else n_layers // 2
    # From the window after the first move's (that one holds the rebuild) to the end, later moves included.
    settled = max(plan.pp_skip, moves[0]["step"] + plan.interval) if moves else plan.pp_skip
    u = pp_run_summary(uniform, plan.pp_skip, [n_layers // 2] * 2)
    b = pp_run_summary(balanced, settled, [boundary, n_layers - boundary])
    ideal = ideal_pipeline(probe_layer_seconds(uniform, plan.probe_s), n_layers, boundary)
    return {
        "uniform": u, "balanced": b, "ideal": ideal, "balanced_over_ideal": ideal["step_s"] / b["step_s"],
        "balanced_over_uniform": b["tokens_per_s"] / u["tokens_per_s"],
        "uniform_predicted_over_measured": ideal["equal_split_step_s"] / u["step_s"],
        "balanced_predicted_over_measured": ideal["balancer_split_step_s"] / b["step_s"],
    }  # fmt: skip


# ---- report ----


def verdicts(result: dict) -> dict[str, bool]:
    """Pass or fail per target of the parts measured."""
    out = {}
    for part in ("dp", "pipeline"):
        if part in result:
            out[f"{part}_balanced_over_ideal"] = result[part]["balanced_over_ideal"] >= TARGETS["balanced_over_ideal"]
            out[f"{part}_balanced_over_uniform"] = (
                result[part]["balanced_over_uniform"] >= TARGETS["balanced_over_uniform"]
            )
    if "change" in result:
        needed = result["change"]["recovery"]["rebalances_needed"]
        out["change_rebalances_to_recover"] = needed is not None and needed <= TARGETS["rebalances_to_recover"]
    return out


def print_table(result: dict) -> None:
    """The headline figures, the dp balanced / ideal ratio last."""
    rows = []
    if "pipeline" in result:
        p = result["pipeline"]
        rows += [("pp step s: equal / balanced / ideal",
                  f"{p['uniform']['step_s']:.3f} / {p['balanced']['step_s']:.3f} / {p['ideal']['step_s']:.3f}"),
                 ("pp layers per rank: balanced / ideal",
                  f"{p['balanced']['layers_per_rank']} / {p['ideal']['layers_per_rank']}"),
                 ("pp balanced / equal split (>= 1.3)", f"{p['balanced_over_uniform']:.3f}"),
                 ("pp balanced / ideal (>= 0.9)", f"{p['balanced_over_ideal']:.3f}")]  # fmt: skip
    if "change" in result:
        c = result["change"]
        rows += [("change tok/s: before / after / new ideal",
                  f"{c['before_tokens_per_s']:.0f} / {c['after_tokens_per_s']:.0f} / "
                  f"{c['new_ideal']['tokens_per_s']:.0f}"),
                 ("change rebalances to within 10 % (<= 3)", str(c["recovery"]["rebalances_needed"]))]  # fmt: skip
    if "dp" in result:
        d = result["dp"]
        rows += [("dp tok/s: uniform / balanced / ideal",
                  f"{d['uniform_tokens_per_s']:.0f} / {d['balanced_tokens_per_s']:.0f} / "
                  f"{d['ideal']['tokens_per_s']:.0f}"),
                 ("dp settled split", str(d["settled_split"])),
                 ("dp balanced / uniform (>= 1.3)", f"{d['balanced_over_uniform']:.3f}"),
                 ("dp balanced / ideal (>= 0.9)", f"{d['balanced_over_ideal']:.3f}")]  # fmt: skip
    for name, value in rows:
        print(f"{name:<44} {value}")


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    return {"cpu": model, "cpu_count": os.cpu_count(), "kernel": platform.release(), "torch": torch.__version__,
            "python": platform.python_version()}  # fmt: skip


def configs(plan: Plan) -> dict:
    """The CLI arguments of every kind of run (besides ``COMMON``, the config file and names)."""
    return {
        "common": COMMON, "dp_uniform": dp_args(plan, plan.dp_steps, False),
        "dp_balanced": dp_args(plan, plan.dp_steps, True),
        "solo": [*plan.dp_model, "--training.global_batch_size=<share>", "--training.micro_batch_size=<share>",
                 "--simulate.rank_speed=[<speed>]", f"--training.steps={plan.solo_steps}", "--nproc 1"],
        "change": [*dp_args(plan, plan.change_steps, True), f"--simulate.speed_change=['{plan.change_at}:0:{SLOWED}']"],
        "pp_uniform": pp_args(plan, False), "pp_balanced": pp_args(plan, True),
    }  # fmt: skip


METHOD = (
    "Real CFS throttling, one rank per cgroup pinned to a core, quotas per core <= 0.9. Steady tokens/s: "
    "total tokens over total seconds inside training steps (metrics.jsonl windows, evaluation excluded) after the "
    "warm-up steps in plan (dp_skip; pp_skip, and for the balanced pipeline up to the window after its first layer "
    "move's). "
    "dp: uniform (fixed 30 each) and balanced runs alternated, medians. dp ideal: sum over ranks of solo tokens/s, "
    "each solo one process alone at the rank's quota training its settled share as one micro-batch with its own "
    "optimizer step, i.e. the balanced run with no waiting and no communication. Change: new ideal likewise at the "
    "new quotas and the shares the run settled on; recovery counts the rebalances after the change that precede the "
    "first logged window within 10 % of it. Pipeline ideal: stage_balance.balanced_stages + predicted_step_s (fill "
    "and drain included; activation transfers and the optimizer step not) on per-layer forward+backward seconds "
    "measured alone under each quota, sustained over probe_s seconds, embedding and head+loss as end items."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["dp", "pipeline", "change", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="a few steps each: a smoke test, not a measurement")
    parser.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/balance.json)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    args = parser.parse_args()
    reason = throttle_requirements()
    if reason is not None:
        sys.exit(f"error: {reason}")
    plan = QUICK if args.quick else FULL
    out = args.out or (Path(tempfile.gettempdir()) / "bench_balance_quick" if args.quick else RESULTS) / "balance.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_balance_"))
    print(f"runs in {work}", flush=True)
    try:
        result = measure(args.part, plan, work, out.with_name("balance_speed_change.png"))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    print_table(result)


def measure(part: str, plan: Plan, work: Path, png: Path) -> dict:
    """The parts asked for, with the run's description, solo rates and verdicts."""
    start = time.perf_counter()
    result: dict = {"machine": machine(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "method": METHOD, "plan": asdict(plan), "configs": configs(plan), "targets": TARGETS}  # fmt: skip
    solo = SoloRates(work, plan)
    if part in ("dp", "all"):
        result["dp"] = measure_dp(work, plan, solo)
    if part in ("change", "all"):
        old = result["dp"]["ideal"] if "dp" in result else None
        change = result["change"] = measure_change(work, plan, solo, old)
        ideals = (old["tokens_per_s"] if old else None, change["new_ideal"]["tokens_per_s"])
        plot_change(Path(change.pop("plot_source")), plan.change_at, ideals, png)
        change["plot"] = png.name
    if part in ("pipeline", "all"):
        result["pipeline"] = measure_pipeline(work, plan)
    result["solo_runs"] = solo.table()
    result["pass"] = verdicts(result)
    result["wall_s"] = time.perf_counter() - start
    return result


if __name__ == "__main__":
    main()
