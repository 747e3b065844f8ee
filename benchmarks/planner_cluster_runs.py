"""``--parallel.auto`` on an emulated cluster (issue #19): 2 hosts × 2 processes joined by a shaped link.

The own-run model of ``planner_own_runs.py`` (its :func:`~planner_own_runs.base_overrides`) runs on
an emulated cluster (``cluster/emulated.py``: network namespaces, a bridge, each host's link shaped
to :data:`LINK_RATE` each way with tc) for the world-4 layouts of :data:`GRID` and with
``--parallel.auto=true --parallel.auto_cluster=<spec>``, :data:`ROUNDS` rounds in alternating order.
Each run's time is the median step from its ``metrics.jsonl`` after :data:`WARMUP` steps.

The planner's spec of the emulated cluster (:func:`emulated_spec`) is measured, not fitted to the
runs: per-rank compute and the collectives inside a host from this machine's calibrated 4-rank spec
(``loomtrain plan --calibrate --ranks 4``: all 4 processes share the cores, as on the emulated
cluster), and a ``[network]`` of the tc rate (``host_gb_per_s``: one link per host, shared by its
ranks) and the inter-host latency the first run's topology probe measures (``<run>/topology.json``).
Written to :data:`SPEC`; results to :data:`RESULTS`.

``--from-results`` runs nothing: it reprices the kept measurements of :data:`RESULTS` on :data:`SPEC`
with the host rate (the first run's spec gave each rank its share on a link of its own), prints them
and what ``--parallel.auto`` would choose now, and updates both files (measurements kept).

    python benchmarks/planner_cluster_runs.py [--steps 8] [--rounds 2]    # root; ~12 minutes on 2 cores
    python benchmarks/planner_cluster_runs.py --from-results              # a few seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import tempfile
import tomllib
from dataclasses import replace
from pathlib import Path

from planner_own_runs import CONFIG, auto_line, base_overrides, layout_of, run_step_seconds

from loomtrain.cluster.emulated import ClusterSpec, emulated_cluster, missing_requirements, rate_bytes_per_s
from loomtrain.config import load_config, toml_value
from loomtrain.distributed.topology import Topology
from loomtrain.planner.arch import Architecture
from loomtrain.planner.auto import AutoChoice, choose_layout, describe, vocab_size
from loomtrain.planner.calibrate import DISTURBED_MARK, calibrate, write_spec
from loomtrain.planner.cluster import load_cluster_spec
from loomtrain.planner.memory import Layout
from loomtrain.planner.time import Cluster, step_time

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "planner_cluster.json"
SPEC = ROOT / "benchmarks" / "results" / "planner_cluster_spec.toml"
HOSTS, PROCS, LINK_RATE, NAME = 2, 2, "100mbit", "plan"
STEPS, WARMUP, ROUNDS = 8, 3, 2
# TCP payload per byte tc counts on a full frame: MSS 1448 (MTU 1500 less IP, TCP and timestamp
# headers, 52 bytes) of 1514 (with the 14-byte Ethernet header, which tbf counts on a veth).
TCP_PAYLOAD_SHARE = 1448 / 1514
# name: overrides of the world-4 layouts (mesh: tp innermost, then dp, then pp; a host holds 2 ranks)
GRID = {
    "dp4": {"training.micro_batch_size": 2},
    "pp2_dp2": {"parallel.pipeline_parallel_degree": 2, "training.micro_batch_size": 2},
    "tp2_dp2": {"parallel.tensor_parallel_degree": 2},
    "pp4": {"parallel.pipeline_parallel_degree": 4},
    "tp4": {"parallel.tensor_parallel_degree": 4},
}
AUTO = {"parallel.auto": "true", "parallel.auto_cluster": str(SPEC), "training.micro_batch_size": None}
# The first line of the comment --from-results adds to SPEC (a rerun replaces it).
REPRICED = "network.host_gb_per_s"


def emulated_spec(local: dict, latency_s: float) -> dict:
    """The planner spec (``planner/cluster.py`` format, as a dict) of :data:`HOSTS` × :data:`PROCS`
    from ``local``, this machine's calibrated spec of ``HOSTS · PROCS`` ranks: its device, core share
    and the collectives of groups up to :data:`PROCS` ranks (inside a host; the largest such group's
    all-reduce figures as the host's link), and a network of the tc rate (``host_gb_per_s``: GB/s
    per host and direction, shared by the host's :data:`PROCS` ranks) with ``latency_s`` one-way seconds."""
    (host,) = local["hosts"]
    keep = [i for i, g in enumerate(host["group_sizes"]) if g <= PROCS]
    inside = {**host, "count": HOSTS, "devices_per_host": PROCS,
              "intra_gb_per_s": host["group_gb_per_s"][keep[-1]],
              "intra_latency_us": host["group_latency_us"][keep[-1]],
              **{f: [host[f][i] for i in keep] for f in ("group_sizes", "group_gb_per_s", "group_latency_us")},
              "collectives": [c for c in host["collectives"] if c["group_size"] <= PROCS]}  # fmt: skip
    network = {"host_gb_per_s": rate_bytes_per_s(LINK_RATE) / 1e9,
               "inter_latency_us": round(latency_s * 1e6, 1),
               "link_efficiency": round(TCP_PAYLOAD_SHARE, 4)}  # fmt: skip
    source = (f"emulated {HOSTS} hosts x {PROCS} ranks, tc tbf {LINK_RATE} per host link each way (shared by "
              f"its {PROCS} ranks); devices and in-host collectives: {local['source']}; "
              "latency: topology probe")  # fmt: skip
    return {"name": f"emulated-{HOSTS}x{PROCS}", "source": source, "devices": local["devices"], "hosts": [inside],
            "network": network}  # fmt: skip


def toml_text(spec: dict, comments: list[str]) -> str:
    """``spec`` (scalars, then arrays of tables, then tables; one level of nested arrays of tables) as
    TOML, after ``comments``."""
    lines = [f"# {c}" for c in comments] + _pairs(spec)
    for key, value in spec.items():
        for table in value if isinstance(value, list) and value and isinstance(value[0], dict) else []:
            lines += ["", f"[[{key}]]", *_pairs(table)]
            for sub, rows in ((k, v) for k, v in table.items() if _tables(v)):
                lines += [line for row in rows for line in ("", f"[[{key}.{sub}]]", *_pairs(row))]
        if isinstance(value, dict):
            lines += ["", f"[{key}]", *_pairs(value)]
    return "\n".join(lines) + "\n"


def _tables(value: object) -> bool:
    return isinstance(value, list | dict) and (isinstance(value, dict) or bool(value) and isinstance(value[0], dict))


def _pairs(table: dict) -> list[str]:
    return [f"{k} = {toml_value(v)}" for k, v in table.items() if not _tables(v)]


def save_spec(local_text: str, run_dir: Path) -> Cluster:
    """Write :data:`SPEC` (atomically, as calibrated specs are written) from the calibrated
    ``local_text`` and ``run_dir``'s probed inter-host latency; the time model's cluster of it."""
    latency = Topology.load(run_dir / "topology.json").inter_host_latency()
    spec = emulated_spec(tomllib.loads(local_text), latency)
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    disturbed = [local_text.splitlines()[0][2:]] if local_text.startswith(DISTURBED_MARK) else []
    write_spec(SPEC, toml_text(spec, [f"Written by benchmarks/planner_cluster_runs.py on {when}.", *disturbed]))
    return load_cluster_spec(str(SPEC)).to_cluster()


def predicted(line: str) -> float:
    """The predicted step seconds in a launcher's ``chosen:``/``runner-up:`` line (``step X s``)."""
    return float(line.split(": step ")[1].split(" s,")[0])


def measure(steps: int, rounds: int, out_dir: str, local_text: str) -> tuple[dict, Cluster, list[str]]:
    """Seconds per step of each of :data:`GRID` and ``auto`` per round, on the emulated cluster; the
    spec's cluster (written after the first run, whose topology probe gives the latency) and
    ``auto``'s printed chosen and runner-up lines."""
    names, state = [*GRID, "auto"], Path(out_dir) / "clusters"
    measured: dict[str, list[float]] = {n: [] for n in names}
    cluster, lines = None, []
    where, env = ["--cluster", NAME], {"LOOMTRAIN_CLUSTER_DIR": str(state)}
    with emulated_cluster(ClusterSpec(HOSTS, PROCS, LINK_RATE, name=NAME), state_dir=state):
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                overrides = AUTO if name == "auto" else GRID[name]
                seconds, printed = run_step_seconds(HOSTS * PROCS, overrides, out_dir, name, where, env, steps,
                                                    min(WARMUP, steps - 2))  # fmt: skip
                measured[name].append(seconds)
                cluster = cluster or save_spec(local_text, Path(out_dir) / name)
                lines = [auto_line(printed, "chosen"), auto_line(printed, "runner-up")] if name == "auto" else lines
                print(f"round {r} {name}: {seconds:.3f} s", flush=True)
    return measured, cluster, lines


def per_rank_share(cluster: Cluster) -> Cluster:
    """``cluster`` with each rank on a link of its own at its share of the host's rate: how the spec
    format read an emulated host before ``host_gb_per_s`` (``inter_gb_per_s`` = host rate / :data:`PROCS`)."""
    return replace(cluster, inter_bytes_per_s=cluster.inter_bytes_per_s / PROCS, inter_shared_by_host=False)


def predictions(cluster: Cluster) -> dict[str, tuple[float, float]]:
    """Each grid layout's predicted seconds per step on ``cluster`` (the spec: a host link shared by its
    ranks) and on :func:`per_rank_share` of it."""
    vocab, share = vocab_size(load_config(CONFIG)), per_rank_share(cluster)
    layouts = {name: layout_of(HOSTS * PROCS, overrides, vocab) for name, overrides in GRID.items()}
    return {name: (step_time(*lay, cluster).total, step_time(*lay, share).total) for name, lay in layouts.items()}


def row(name: str, predicted: tuple[float, float], measured_s: float, rounds: list[float]) -> dict:
    """One grid layout's result: its :func:`predictions`, its measured seconds (median and each
    round) and ``error``, the spec's prediction over the median, less 1."""
    return {"config": name, "predicted_s": round(predicted[0], 4), "predicted_per_rank_share_s": round(predicted[1], 4),
            "measured_s": round(measured_s, 4), "measured_each_round_s": [round(m, 4) for m in rounds],
            "error": round(predicted[0] / measured_s - 1, 4)}  # fmt: skip


def rows(measured: dict, cluster: Cluster) -> list[dict]:
    """Each grid layout's :func:`row` from its seconds per round in ``measured``."""
    return [row(name, pred, statistics.median(measured[name]), measured[name])
            for name, pred in predictions(cluster).items()]  # fmt: skip


def plan_on(cluster: Cluster) -> AutoChoice:
    """What ``--parallel.auto`` chooses for the own-run model's :data:`AUTO` job on ``cluster``."""
    cfg = load_config(CONFIG, [f"--{k}={v}" for k, v in {**base_overrides(), **AUTO}.items() if v is not None])
    return choose_layout(cfg, HOSTS * PROCS, cluster)


def print_table(grid: list[dict]) -> None:
    """The grid's predicted (and per-rank-share) and measured seconds and errors."""
    for r in grid:
        share, rounds = r["predicted_per_rank_share_s"], r["measured_each_round_s"]
        print(f"{r['config']:>8}: predicted {r['predicted_s']:.3f} s (per-rank share {share:.3f}), "
              f"measured {r['measured_s']:.3f} s {rounds} ({100 * r['error']:+.1f} %)")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    """Calibrate, run, print and write :data:`RESULTS`."""
    if (missing := missing_requirements()) is not None:
        sys.exit(f"cannot emulate a cluster here: {missing}")
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    local_text = calibrate(HOSTS * PROCS)
    with tempfile.TemporaryDirectory() as out_dir:
        measured, cluster, (chosen, runner_up) = measure(args.steps, args.rounds, out_dir, local_text)
    grid = rows(measured, cluster)
    best, auto = min(grid, key=lambda r: r["measured_s"]), statistics.median(measured["auto"])
    result = {"date": started, "hosts": HOSTS, "procs_per_host": PROCS, "inter_rate": LINK_RATE, "steps": args.steps,
              "warmup": min(WARMUP, args.steps - 2), "rounds": args.rounds, "spec": str(SPEC.relative_to(ROOT)),
              "calibration_disturbed": local_text.startswith(DISTURBED_MARK), "rows": grid,
              "auto": {"chosen": chosen, "runner_up": runner_up, "predicted_s": predicted(chosen),
                       "runner_up_predicted_s": predicted(runner_up), "measured_s": round(auto, 4),
                       "measured_each_round_s": [round(m, 4) for m in measured["auto"]],
                       "best_grid_config": best["config"], "best_grid_measured_s": best["measured_s"],
                       "tokens_per_s_over_best_grid": round(best["measured_s"] / auto, 3)}}  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print_table(grid)
    print(f"auto: {chosen}\n      {runner_up}")
    print(f"  measured {auto:.3f} s; tokens/s over {best['config']}: {best['measured_s'] / auto:.3f}")


def host_rate_spec() -> Cluster:
    """Rewrite :data:`SPEC` with the tc rate of a host's link as ``host_gb_per_s`` in place of the
    first run's per-rank share (``inter_gb_per_s``), its other figures and comments kept; its cluster.

    Raises:
        SystemExit: the spec's ``inter_gb_per_s`` is not :data:`LINK_RATE`'s share per rank (not the
            spec the kept runs were priced with).
    """
    text, host = SPEC.read_text(), rate_bytes_per_s(LINK_RATE) / 1e9
    doc = tomllib.loads(text)
    network = doc["network"]
    share = network.pop("inter_gb_per_s", host / PROCS)
    if not math.isclose(share * PROCS, host):
        sys.exit(f"{SPEC}: inter_gb_per_s={share} is not {LINK_RATE}'s share per rank ({host / PROCS} GB/s)")
    doc["network"] = {"host_gb_per_s": host, **{k: v for k, v in network.items() if k != "host_gb_per_s"}}
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    kept = [line[2:] for line in text.splitlines() if line.startswith("# ") and not line.startswith(f"# {REPRICED}")]
    note = (f"{REPRICED} = {host}: the tc rate of a host's one link ({LINK_RATE}), shared by its {PROCS} ranks, in "
            f"place of inter_gb_per_s = {host / PROCS} (each rank's share); planner_cluster_runs.py --from-results, "
            f"{when}.")  # fmt: skip
    write_spec(SPEC, toml_text(doc, [*kept, note]))
    return load_cluster_spec(str(SPEC)).to_cluster()


def launched(choice: AutoChoice, vocab: int) -> tuple[Architecture, Layout]:
    """The ``(Architecture, Layout)`` of the run ``choice``'s overrides make, as :func:`rows` prices the grid."""
    return layout_of(HOSTS * PROCS, dict(o.removeprefix("--").split("=", 1) for o in choice.overrides), vocab)


def layout_part(line: str) -> str:
    """The layout of a ``chosen:`` line: without its label and its predictions (``: step ...``)."""
    return line.split(": step")[0].split(": ", 1)[1]


def repriced_choice(now: AutoChoice, ran_layout: Layout, grid: list[dict], vocab: int, best_s: float) -> dict:
    """What ``--parallel.auto`` chooses now (``now``): its lines and predictions, whether it is the
    auto run's layout (``ran_layout``) or a grid layout, and then that run's tokens/s over the best
    grid layout's (``best_s`` seconds per step)."""
    now_layout = launched(now, vocab)[1]
    same = next((r for r in grid if layout_of(HOSTS * PROCS, GRID[r["config"]], vocab)[1] == now_layout), None)
    chosen, runner_up = auto_line(describe(now), "chosen"), auto_line(describe(now), "runner-up")
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": "python benchmarks/planner_cluster_runs.py --from-results",
            "chosen": chosen, "runner_up": runner_up, "predicted_s": predicted(chosen),
            "runner_up_predicted_s": predicted(runner_up), "same_layout_as_auto_run": now_layout == ran_layout,
            "same_layout_as_grid": same and same["config"],
            "tokens_per_s_over_best_grid": same and round(best_s / same["measured_s"], 3)}  # fmt: skip


def from_results() -> None:
    """Reprice :data:`RESULTS`' measurements on :data:`SPEC` with the host rate (:func:`host_rate_spec`),
    print them and what ``--parallel.auto`` chooses now, and update :data:`RESULTS`: the grid's
    predictions, the auto run's layout priced now (``predicted_host_link_s``), the choice now and the
    date of the repricing (``repriced``); the measurements and the run's date are kept.

    Raises:
        SystemExit: the per-rank share no longer chooses the layout the auto run measured (the spec
            or the planner changed since), or as :func:`host_rate_spec`.
    """
    result = json.loads(RESULTS.read_text())
    cluster, vocab, auto = host_rate_spec(), vocab_size(load_config(CONFIG)), result["auto"]
    ran = plan_on(per_rank_share(cluster))
    if layout_part(auto_line(describe(ran), "chosen")) != layout_part(auto["chosen"]):
        sys.exit(f"the per-rank share no longer chooses the measured auto layout ({auto['chosen']}); rerun the runs")
    arch, ran_layout = launched(ran, vocab)
    preds = predictions(cluster)
    grid = [row(r["config"], preds[r["config"]], r["measured_s"], r["measured_each_round_s"]) for r in result["rows"]]
    auto.pop("chosen_whole_link", None)  # the first run's other reading of the link: the spec's own now
    auto["predicted_host_link_s"] = round(step_time(arch, ran_layout, cluster).total, 4)
    now = repriced_choice(plan_on(cluster), ran_layout, grid, vocab, auto["best_grid_measured_s"])
    result["rows"], result["repriced"] = grid, now
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print_table(grid)
    error = auto["predicted_host_link_s"] / auto["measured_s"] - 1
    print(f"auto as run: {layout_part(auto['chosen'])}: predicted {auto['predicted_host_link_s']:.3f} s, "
          f"measured {auto['measured_s']:.3f} s ({100 * error:+.1f} %)")  # fmt: skip
    print(f"auto now: {now['chosen']}\n          {now['runner_up']}")
    if now["same_layout_as_grid"]:
        print(f"  run as {now['same_layout_as_grid']}: tokens/s over {auto['best_grid_config']}: "
              f"{now['tokens_per_s_over_best_grid']:.3f}")  # fmt: skip


def main() -> None:
    """Run the layouts on an emulated cluster, or with ``--from-results`` reprice the kept ones."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--from-results", action="store_true",
                        help=f"run nothing: reprice the runs of {RESULTS.name} with the host rate")  # fmt: skip
    args = parser.parse_args()
    if args.from_results:
        from_results()
    else:
        run(args)


if __name__ == "__main__":
    main()
