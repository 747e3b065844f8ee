"""The planner against published runs, its rankings, and the cost of its search.

Prints Megatron-LM's Tables 1 and 2 (Narayanan et al., SC 2021) beside the time model's predictions;
the Fig. 13 (t, p) ranking of the 162.2B GPT on 64 A100s and the Fig. 16 micro-batch ranking of the 91B GPT
at t = p = 8; the time of a 1,024-GPU layout search for each of the presets llama3-8b, llama3-70b,
llama3-405b and gpt3-175b on the DGX A100 and H100 specs, with each search's best layout; and the 22-row
MAPE last. Writes ``benchmarks/results/planner.json``. Every figure except the published ones and the
search times is a model prediction. Before them (unless ``--skip-own-runs``), the own-run check of
``benchmarks/planner_own_runs.py``: real loomtrain runs at world 2 and 4 against the predictions from
this machine's calibrated specs, and ``--parallel.auto``'s choice against the best of them.

    python benchmarks/bench_planner.py [--skip-own-runs]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from planner_own_runs import own_runs, separated

from loomtrain.planner.arch import gpt
from loomtrain.planner.cli import resolve_model
from loomtrain.planner.cluster import load_cluster_spec
from loomtrain.planner.published import (
    MEGATRON_RUNS,
    SELENE,
    constant_predictor_errors,
    errors,
    held_out_errors,
    held_out_rows,
    mape,
    megatron_layout,
    table_rows,
)
from loomtrain.planner.search import search
from loomtrain.planner.time import tflops_per_gpu

RESULTS = Path(__file__).resolve().parent / "results" / "planner.json"
# Megatron-LM examples/sc21/run_figure_13.sh and run_figure_16.sh: the figures' model shapes.
FIG13, FIG16 = gpt(32, 20480, 128, name="gpt-162.2b"), gpt(32, 15360, 128, name="gpt-91b")
SEARCHES = (("llama3-8b", 1024, 8192), ("llama3-70b", 1024, 8192), ("llama3-405b", 2048, 8192),
            ("gpt3-175b", 1536, 2048))  # fmt: skip


def _tflops(arch, tp: int, pp: int, batch: int, micro_batch: int = 1) -> float:
    layout = megatron_layout(64 // (tp * pp), tp, pp, batch // micro_batch, micro_batch)
    return round(tflops_per_gpu(arch, layout, SELENE), 1)


def rankings() -> dict:
    """Predicted TFLOP/s per GPU of Fig. 13's (t, p) splits and Fig. 16's micro-batch sizes."""
    fig13 = {f"batch {b}": {f"t{t} p{64 // t}": _tflops(FIG13, t, 64 // t, b) for t in (32, 16, 8, 4, 2)}
             for b in (32, 128)}  # fmt: skip
    fig16 = {f"batch {b}": {f"b{mb}": _tflops(FIG16, 8, 8, b, mb) for mb in (1, 2, 4, 8)} for b in (128, 512)}
    return {"fig13_tp_pp": fig13, "fig16_micro_batch": fig16}


def searches() -> list[dict]:
    """Each preset searched on 1,024 GPUs of each DGX spec: seconds, layouts, and the best one."""
    out = []
    for spec_name in ("dgx-a100", "dgx-h100"):
        cluster = load_cluster_spec(spec_name).to_cluster()
        for name, batch, seq_len in SEARCHES:
            started = time.perf_counter()
            result = search(resolve_model(name), cluster, batch, seq_len=seq_len)
            elapsed = time.perf_counter() - started
            best = result.plans[0]
            lay = best.layout
            out.append({"cluster": spec_name, "model": name, "global_batch": batch, "seq_len": seq_len,
                        "search_s": round(elapsed, 2), "considered": result.considered, "fit": len(result.plans),
                        "best": {"dp": lay.dp, "dp_replicate": lay.dp_replicate, "zero_stage": lay.zero_stage,
                                 "tp": lay.tp, "sequence_parallel": lay.sequence_parallel, "sp": lay.sp, "pp": lay.pp,
                                 "virtual_stages": lay.virtual_stages, "micro_batch": lay.micro_batch,
                                 "recompute": lay.recompute, "memory_gib": round(best.memory_bytes / 2**30, 1),
                                 "step_s": round(best.step.total, 3), "mfu": round(best.mfu, 3)}})  # fmt: skip
    return out


def main() -> None:
    """Run everything, write the JSON, print the tables and the 22-row MAPE last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-own-runs", action="store_true",
                        help="leave out the real runs on this machine (28 minutes on a 2-core EPYC)")  # fmt: skip
    args = parser.parse_args()
    own = None if args.skip_own_runs else own_runs(auto=True)
    if own is not None:
        print(
            f"own runs: MAPE {100 * own['mape']:.1f} %, Kendall tau {own['kendall_tau']:.3f}, over the "
            f"{own['separated_pairs']} pairs the rounds separate {own['kendall_tau_separated']:.3f}; "
            f"the rounds against one another {own['kendall_tau_between_rounds']:.3f}"
        )
    rows = table_rows()
    print("| table | params (B) | t | p | GPUs | batch | b | published TFLOP/s | predicted | error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['table']} | {r['params_b']} | {r['tp']} | {r['pp']} | {r['gpus']} | {r['batch']} | "
              f"{r['micro_batch']} | {r['published_tflops']:.0f} | {r['predicted_tflops']:.1f} | "
              f"{100 * r['error']:+.1f} % |")  # fmt: skip
    held = held_out_rows()
    for r in held:
        print(f"held out {r['model']} {r['recompute']}: {r['published_s']} s published, {r['predicted_s']} s "
              f"predicted ({100 * r['error']:+.1f} %)")  # fmt: skip
    ranks = rankings()
    print(json.dumps(ranks, indent=1))
    found = searches()
    for s in found:
        print(f"{s['cluster']} {s['model']}: {s['considered']} layouts in {s['search_s']} s, best {s['best']}")
    errs = errors(MEGATRON_RUNS)
    summary = {"rows": len(errs), "mape_percent": round(mape(errs), 2),
               "worst_row_percent": round(100 * max(errs, key=abs), 2),
               "best_constant_mape_percent": round(mape(constant_predictor_errors(MEGATRON_RUNS)), 2),
               "held_out_mape_percent": round(mape(held_out_errors()), 2),
               "held_out_worst_percent": round(100 * max(held_out_errors(), key=abs), 2)}  # fmt: skip
    previous = json.loads(RESULTS.read_text()).get("own_runs") if RESULTS.is_file() else None
    if own is None and previous is not None:
        previous.update(separated(previous["rows"]))  # the kept measurements, τ over separated pairs again
    RESULTS.write_text(json.dumps({"published": rows, "held_out": held, "rankings": ranks, "searches": found,
                                   "summary": summary, "own_runs": own or previous}, indent=2) + "\n")  # fmt: skip
    print(f"best constant predictor MAPE {summary['best_constant_mape_percent']:.1f} %; worst row "
          f"{summary['worst_row_percent']:+.1f} %")  # fmt: skip
    print(f"22-row MAPE (Megatron-LM Tables 1 + 2): {summary['mape_percent']:.1f} %")


if __name__ == "__main__":
    main()
