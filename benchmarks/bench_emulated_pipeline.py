"""Pipeline schedules on emulated devices: the measured bubble against the formulas at pp 4 and 8,
and the pp 8 comparison of 1F1B, interleaved 1F1B (v = 2, 4) and ZB-H1 at the same m.

Every forward and backward takes the time ``distributed/pipeline/emulated.py``'s cost model gives an
emulated GPU (default H100) for an equal stage of a Llama-3.1-405B-shaped model with 128 layers
(126 in the paper; 128 so that pp·v ∈ {4, …, 32} stages are equal, as the formulas assume) and
16 tokens per micro-batch; the output head is left out for the same reason. The executor, the
schedules and the point-to-point transfers (512 KiB bf16 tensors over gloo) are real. 8 gloo
processes: one pipeline of 8, or two pipelines of 4 side by side (both reported).

Per case, one step after a warm-up step per pipeline degree:

- ``bubble``: the executor's measurement (mean over ranks of idle / step, from the device clocks);
- ``theory``: GPipe and 1F1B (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1), ZB-H1 idle (p−1)(T_F+T_B−T_W)
  (``schedule.theoretical_bubble``);
- ``step_s`` against ``replayed_s`` (the schedule replayed with the cost model's action times and free
  messages) and the host's ``wall_s``: equal when the host keeps up with the emulated devices, larger
  when it does not (then the bubble shows this machine, not the schedule: such cases are listed, and
  the worst gap printed last is over the others).

These are figures of a cost model, not measurements of GPUs. Writes
``benchmarks/results/emulated_pipeline.json`` and, for the pp 8 comparison at m = 16, Gantt charts
``docs/img/emulated_pp8_<schedule>.png``; prints the worst |measured − theory| gap last.

    OMP_NUM_THREADS=1 python benchmarks/bench_emulated_pipeline.py [--device h100]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch.distributed as dist

from loomtrain.config import ModelConfig
from loomtrain.distributed.pipeline.emulated import device, measure_step
from loomtrain.distributed.pipeline.p2p import PipelineComm
from loomtrain.distributed.spawn import spawn
from loomtrain.emulated_run import HOST_BOUND_MARGIN
from loomtrain.report import plot_gantt

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "emulated_pipeline.json"
IMAGES = ROOT / "docs" / "img"
# Dubey et al., "The Llama 3 Herd of Models" (2024), Table 3, with 128 layers instead of 126.
MODEL = ModelConfig(dim=16384, n_heads=128, n_kv_heads=8, ffn_hidden_dim=53248, n_layers=128, vocab_size=128000,
                    max_seq_len=8192)  # fmt: skip
SEQ_LEN, MICRO_BATCH, WORLD = 16, 1, 8
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))
CHART_M = 16  # the pp 8 comparison drawn as Gantt charts


def cases(pp: int) -> list[tuple[str, int, int]]:
    """``(schedule, m, v)`` for m in {pp, 2 pp, 4 pp}."""
    return [(name, m, v) for m in (pp, 2 * pp, 4 * pp) for name, v in SCHEDULES]


def worker(device_name: str) -> list[dict]:
    """Every case on this rank; rows are per pipeline (from its first rank), timelines for the charts."""
    dev, rows = device(device_name), []
    for pp in (4, 8):
        comm = PipelineComm.consecutive(pp)
        measure_step(comm, MODEL, "interleaved_1f1b", pp, 2, SEQ_LEN, MICRO_BATCH, dev)
        for name, m, v in cases(pp):
            chart = pp == 8 and m == CHART_M
            got = measure_step(comm, MODEL, name, m, v, SEQ_LEN, MICRO_BATCH, dev, timeline=chart)
            if comm.pp_rank == 0:
                rows.append({"pp": pp, "pipeline": dist.get_rank() // pp, "schedule": name, "v": v, "m": m, **got})
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| pp | pipeline | schedule | v | m | bubble | formula | gap (points) | step (s) | replay (s) | "
             "step / replay | host wall / replay |", "|" + " --- |" * 12]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['pp']} | {r['pipeline']} | {r['schedule']} | {r['v']} | {r['m']} | {r['bubble']:.1%} | "
            f"{r['theory']:.1%} | {100 * (r['bubble'] - r['theory']):+.2f} | {r['step_s']:.3f} | "
            f"{r['replayed_s']:.3f} | {r['step_s'] / r['replayed_s']:.3f} | {r['wall_s'] / r['replayed_s']:.3f} |"
        )
    return "\n".join(lines)


def _comparison(rows: list[dict]) -> list[dict]:
    """pp 8 at each m: every schedule's step time and bubble, and 1F1B's step time over its own."""
    out = []
    for m in sorted({r["m"] for r in rows if r["pp"] == 8}):
        same = [r for r in rows if r["pp"] == 8 and r["m"] == m]
        base = next(r for r in same if r["schedule"] == "1f1b")
        out += [{"m": m, "schedule": r["schedule"], "v": r["v"], "step_s": r["step_s"], "bubble": r["bubble"],
                 "speedup_over_1f1b": base["step_s"] / r["step_s"]}
                for r in same if r["schedule"] != "gpipe"]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="h100", help="emulated device (a100, h100)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = [row for rank_rows in spawn(worker, WORLD, args.device, timeout_s=1800) for row in rank_rows]
    IMAGES.mkdir(parents=True, exist_ok=True)
    for r in rows:
        timeline = r.pop("timeline", None)
        if timeline is not None:
            plot_gantt(timeline, IMAGES / f"emulated_pp8_{r['schedule']}{'_v' + str(r['v']) if r['v'] > 1 else ''}.png")
    rows.sort(key=lambda r: (r["pp"], r["m"], r["pipeline"], r["schedule"], r["v"]))
    for r in rows:
        r["host_bound"] = r["step_s"] > r["replayed_s"] * (1 + HOST_BOUND_MARGIN)
    kept_up = [r for r in rows if not r["host_bound"]]
    worst = max(kept_up, key=lambda r: abs(r["bubble"] - r["theory"]))
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": args.device,
        "note": "emulated devices: times from a cost model, not measured on GPUs", "cpu_count": os.cpu_count(),
        "model": MODEL.model_dump(), "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "rows": rows,
        "pp8_comparison": _comparison(rows), "worst_gap_points": 100 * abs(worst["bubble"] - worst["theory"]),
        "host_bound_cases": [f"{r['schedule']} v={r['v']} pp={r['pp']} m={r['m']}" for r in rows if r["host_bound"]],
    }  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=2))
    print(_table(rows))
    for c in result["pp8_comparison"]:
        print(f"pp 8, m {c['m']}: {c['schedule']} v={c['v']}: step {c['step_s']:.3f} s, bubble {c['bubble']:.1%}, "
              f"{c['speedup_over_1f1b']:.2f}x 1F1B's throughput")  # fmt: skip
    print(f"cases where this host fell behind the emulated devices (step > replay + 5 %; their bubble shows the "
          f"host): {', '.join(result['host_bound_cases']) or 'none'}")  # fmt: skip
    print(f"worst |measured - theory| gap where the host kept up: {result['worst_gap_points']:.2f} points "
          f"({worst['schedule']} v={worst['v']} pp={worst['pp']} m={worst['m']})")  # fmt: skip


if __name__ == "__main__":
    main()
