"""``--parallel.auto`` on an emulated cluster (issue #19): 2 hosts × 2 processes joined by a shaped link.

The own-run model of ``planner_own_runs.py`` (its :func:`~planner_own_runs.base_overrides`) runs on
an emulated cluster (``cluster/emulated.py``: network namespaces, a bridge, each host's link shaped
to :data:`LINK_RATE` each way with tc) for the world-4 layouts of :data:`GRID` and with
``--parallel.auto=true --parallel.auto_cluster=<spec>``, :data:`ROUNDS` rounds in alternating order.
Each run's time is the median step from its ``metrics.jsonl`` after :data:`WARMUP` steps.

The planner's spec of the emulated cluster (:func:`emulated_spec`) is measured, not fitted to the
runs: per-rank compute and the collectives inside a host from this machine's calibrated 4-rank spec
(``loomtrain plan --calibrate --ranks 4``: all 4 processes share the cores, as on the emulated
cluster), and a ``[network]`` of the tc rate and the inter-host latency the first run's topology
probe measures (``<run>/topology.json``). Written to :data:`SPEC`; results to :data:`RESULTS`.

    python benchmarks/planner_cluster_runs.py [--steps 8] [--rounds 2]    # root; ~12 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import tomllib
from dataclasses import replace
from pathlib import Path

from planner_own_runs import CONFIG, base_overrides, layout_of, run_step_seconds

from loomtrain.cluster.emulated import ClusterSpec, emulated_cluster, missing_requirements, rate_bytes_per_s
from loomtrain.config import load_config, toml_value
from loomtrain.distributed.topology import Topology
from loomtrain.planner.auto import choose_layout, describe, vocab_size
from loomtrain.planner.calibrate import DISTURBED_MARK, calibrate, write_spec
from loomtrain.planner.cluster import load_cluster_spec
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


def emulated_spec(local: dict, latency_s: float) -> dict:
    """The planner spec (``planner/cluster.py`` format, as a dict) of :data:`HOSTS` × :data:`PROCS`
    from ``local``, this machine's calibrated spec of ``HOSTS · PROCS`` ranks: its device, core share
    and the collectives of groups up to :data:`PROCS` ranks (inside a host; the largest such group's
    all-reduce figures as the host's link), and a network of the tc
    rate (bytes/s per host and direction, shared by the host's :data:`PROCS` ranks: each rank's share
    when all send, as the format counts a link per device) with ``latency_s`` one-way seconds."""
    (host,) = local["hosts"]
    keep = [i for i, g in enumerate(host["group_sizes"]) if g <= PROCS]
    inside = {**host, "count": HOSTS, "devices_per_host": PROCS,
              "intra_gb_per_s": host["group_gb_per_s"][keep[-1]],
              "intra_latency_us": host["group_latency_us"][keep[-1]],
              **{f: [host[f][i] for i in keep] for f in ("group_sizes", "group_gb_per_s", "group_latency_us")},
              "collectives": [c for c in host["collectives"] if c["group_size"] <= PROCS]}  # fmt: skip
    network = {"inter_gb_per_s": rate_bytes_per_s(LINK_RATE) / PROCS / 1e9,
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


def auto_line(printed: str, label: str) -> str:
    """The launcher's ``chosen:`` or ``runner-up:`` line of ``--parallel.auto``."""
    return next(line.strip() for line in printed.splitlines() if line.strip().startswith(f"{label}:"))


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


def rows(measured: dict, cluster: Cluster) -> list[dict]:
    """Each grid layout's predicted (the spec; and with the whole link per rank) and measured seconds."""
    vocab = vocab_size(load_config(CONFIG))
    whole_link = replace(cluster, inter_bytes_per_s=cluster.inter_bytes_per_s * PROCS)
    out = []
    for name, overrides in GRID.items():
        arch, layout = layout_of(HOSTS * PROCS, overrides, vocab)
        pred, median = step_time(arch, layout, cluster).total, statistics.median(measured[name])
        out.append({"config": name, "predicted_s": round(pred, 4),
                    "predicted_whole_link_s": round(step_time(arch, layout, whole_link).total, 4),
                    "measured_s": round(median, 4), "measured_each_round_s": [round(m, 4) for m in measured[name]],
                    "error": round(pred / median - 1, 4)})  # fmt: skip
    return out


def whole_link_choice(cluster: Cluster) -> str:
    """The ``chosen:`` line ``--parallel.auto`` prints on ``cluster`` with the whole link per rank (the
    other reading of a host link shared by its ranks)."""
    whole_link = replace(cluster, inter_bytes_per_s=cluster.inter_bytes_per_s * PROCS)
    cfg = load_config(CONFIG, [f"--{k}={v}" for k, v in {**base_overrides(), **AUTO}.items() if v is not None])
    return auto_line(describe(choose_layout(cfg, HOSTS * PROCS, whole_link)), "chosen")


def main() -> None:
    """Calibrate, run, print and write :data:`RESULTS`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
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
                       "runner_up_predicted_s": predicted(runner_up), "chosen_whole_link": whole_link_choice(cluster),
                       "measured_s": round(auto, 4),
                       "measured_each_round_s": [round(m, 4) for m in measured["auto"]],
                       "best_grid_config": best["config"], "best_grid_measured_s": best["measured_s"],
                       "tokens_per_s_over_best_grid": round(best["measured_s"] / auto, 3)}}  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for r in grid:
        print(f"{r['config']:>8}: predicted {r['predicted_s']:.3f} s (whole link {r['predicted_whole_link_s']:.3f}), "
              f"measured {r['measured_s']:.3f} s {r['measured_each_round_s']} ({100 * r['error']:+.1f} %)")  # fmt: skip
    print(f"auto: {chosen}\n      {runner_up}\n  whole link: {result['auto']['chosen_whole_link']}")
    print(f"  measured {auto:.3f} s; tokens/s over {best['config']}: {best['measured_s'] / auto:.3f}")


if __name__ == "__main__":
    main()
