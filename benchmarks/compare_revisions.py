"""A benchmark's ratios under two revisions of loomtrain, run interleaved in one session.

For a change that must not alter speed (a refactor), the benchmark runs alternately on the
base revision (a git worktree of ``--base``, its own benchmark script against its own code)
and on this working tree, ``--rounds`` times each, order alternating per round, so machine
noise hits both alike. Each run's JSON result is read and its ratios against the peer (ours /
torch, compressed / uncompressed) are taken; the report is the median of each ratio per
revision and ``new / base``. Writes ``--out`` (default ``benchmarks/results/revisions_<bench>.json``)
and prints the largest ``|new / base - 1|`` last. The checked-in result file of this tree is restored
afterwards, so the comparison's own runs never replace it.

    python benchmarks/compare_revisions.py --base HEAD~1 --bench dp --rounds 2 -- --rounds 4
    python benchmarks/compare_revisions.py --base main --bench compression -- --steps 300 --methods none topk_0.01
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _zero(d: dict) -> dict[str, float]:
    return {k: v["ratio"] for k, v in d.items() if k.startswith("world_")}


def _pipeline(d: dict) -> dict[str, float]:
    return {f"{c['schedule']}_pp{c['pp']}_m{c['m']}": c["ratio"] for c in d["cases"] if c.get("ratio") is not None}


def _compression(d: dict) -> dict[str, float]:
    out = {}
    for method in d["methods"]:
        out[f"{method}.val_loss_ratio"] = d[method]["val_loss_ratio"]
        out[f"{method}.compression_ratio"] = d[method]["compression_ratio"]
    return out


# Per benchmark: its script, its result file, and the ratios to compare.
BENCHES = {
    "dp": ("bench_dp.py", "dp.json", lambda d: {"ours/ddp": d["ratio"]}),
    "zero": ("bench_zero.py", "zero.json", _zero),
    "tp": ("bench_tp.py", "tp.json", lambda d: {"ours/parallelize_module": d["step_time_tp2"]["ratio"]}),
    "pipeline": ("bench_pipeline.py", "pipeline.json", _pipeline),
    "compression": ("bench_compression.py", "compression.json", _compression),
}


def run_once(tree: Path, bench: str, args: list[str]) -> dict[str, float]:
    """Run ``bench`` of ``tree`` against ``tree``'s own sources; its ratios."""
    script, result, ratios = BENCHES[bench]
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args], cwd=tree, env=env, check=True)
    return ratios(json.loads((tree / "benchmarks" / "results" / result).read_text()))


def compare(base: Path, bench: str, rounds: int, args: list[str]) -> dict:
    """Interleaved runs, base and new alternating first; medians and new / base per ratio."""
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for r in range(rounds):
        order = [("base", base), ("new", ROOT)] if r % 2 == 0 else [("new", ROOT), ("base", base)]
        for label, tree in order:
            runs[label].append(run_once(tree, bench, args))
    med = {label: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for label, rs in runs.items()}
    change = {k: med["new"][k] / med["base"][k] for k in med["new"] if k in med["base"] and med["base"][k]}
    return {"bench": bench, "args": args, "rounds": rounds, "runs": runs, "median": med, "new_over_base": change}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision to compare with (a worktree is made of it)")
    p.add_argument("--bench", required=True, choices=list(BENCHES))
    p.add_argument("--rounds", type=int, default=2, help="runs of each revision")
    p.add_argument("--out", type=Path, help="where the JSON goes (default: results/revisions_<bench>.json)")
    p.add_argument("bench_args", nargs="*", help="arguments for the benchmark script (after --)")
    a = p.parse_args()
    own_result = RESULTS / BENCHES[a.bench][1]
    saved = own_result.read_bytes() if own_result.exists() else None
    with tempfile.TemporaryDirectory(prefix="loomtrain-base-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), a.base], check=True)
        try:
            report = compare(base, a.bench, a.rounds, a.bench_args)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
            if saved is not None:
                own_result.write_bytes(saved)
    report["base"] = a.base
    (a.out or RESULTS / f"revisions_{a.bench}.json").write_text(json.dumps(report, indent=2))
    for key, value in report["new_over_base"].items():
        print(f"{key}: base {report['median']['base'][key]:.4f}, new {report['median']['new'][key]:.4f}, "
              f"new/base {value:.4f}")  # fmt: skip
    worst = max(report["new_over_base"].values(), key=lambda v: abs(v - 1), default=1.0)
    print(f"largest change new/base: {worst:.4f}")


if __name__ == "__main__":
    main()
