"""Pipeline parallelism: measured bubble fraction against theory, and our step time against
``torch.distributed.pipelining`` on the same stages.

Bubble: for pp in {2, 4}, m in {4, 8, 16} micro-batches and each schedule, the executor's
measured bubble (mean over ranks of idle time / step time, from every action's recorded start
and end) as the median over steps after a warm-up (at the raced m: over our raced steps),
against the zero-communication theory

- GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush; Narayanan et al. 2021, §2.2.1): each rank
  idles ``(p−1)(t_f+t_b)`` of ``(m+p−1)(t_f+t_b)``, a bubble of ``(p−1)/(m+p−1)``;
- interleaved 1F1B with ``v`` chunks per rank (Narayanan et al. 2021, §2.2.2): the idle time is
  divided by ``v``, a bubble of ``(p−1)/(v·m+p−1)``;

and the gap in percentage points (target: within 3). Stages are runs of equal numbers of
layers; the first also embeds, the last also applies the norm, head and loss, so the stages are
not exactly equal. The formulas assume equal stages and free messages; to tell the two apart,
``ideal_bubble`` replays each measured step's schedule (``schedule.simulate``) with that step's
mean measured duration of every (forward or backward, stage) and zero message time: the bubble
the stages as they ran would have with free, instant communication. ``measured − ideal`` is
what the executor's messages and waiting add.

Step time: per schedule at m = 8, ours (``PipelineExecutor``) against torch's ``ScheduleGPipe``,
``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` over ``PipelineStage``s running the same pruned
stages, same initial weights, data and loss (mean cross-entropy per micro-batch, gradients
divided by m); forward and backward only, gradients zeroed before each step. Both must give
the same gradients (asserted, 1e-4 relative per parameter) before they are timed. Interleaved
rounds of alternating order (``timing.py``), median step seconds of the slowest rank, ratio
ours / torch (lower is better; target ≤ 1.05).

One gloo process per pipeline rank, one torch thread each. glibc is told to keep freed memory
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` set for the worker processes unless
already set): by default it hands every step's large activation blocks back to the operating
system and page-faults them in again on the next step, which stretched the first actions of a
step by up to 3× and made action times vary by 2× on the 2-core machine; both implementations
run under the same setting. The default model (8 layers × width
256, micro-batch 2 × 128 tokens) takes about 10 ms per layer forward on one core, so even a
one-layer stage (pp = 4, v = 2) computes far longer than a message takes. pp = 4 runs 4
processes: on a machine with fewer cores (``cpu_count`` in the JSON) they time-share, which
stretches and shifts actions unevenly and distorts the measured bubble; it is still reported.
Writes ``benchmarks/results/pipeline.json`` and prints the worst |measured − theory| gap last.

    python benchmarks/bench_pipeline.py [--pp 2 4 --micro 4 8 16 --steps 5 --race-pp 2 4 --rounds 3]
    python benchmarks/bench_pipeline.py --pp 2 --micro 4 --steps 1 --race-micro 4 --rounds 1 --race-steps 1  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import interleaved_rounds
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from loomtrain.config import ModelConfig
from loomtrain.distributed.pipeline.executor import PipelineExecutor, StepRecord
from loomtrain.distributed.pipeline.p2p import PipelineComm
from loomtrain.distributed.pipeline.schedule import bubble_fraction, simulate, theoretical_bubble
from loomtrain.distributed.pipeline.split import partition_layers
from loomtrain.distributed.spawn import spawn
from loomtrain.models import Transformer
from loomtrain.models.parallelize import prune_to_rank

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"
CPU = torch.device("cpu")
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
GRAD_RTOL = 1e-4


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _TorchStage(nn.Module):
    """One stage of a pruned model for a torch ``PipelineStage``: ``forward(x)`` runs
    ``model(x, 0, layers=keys)``. It registers only that stage's modules, because torch scales
    gradients over ``submodule.parameters()``: the rank's whole model under each of ``v``
    stages would be scaled ``v`` times."""

    def __init__(self, model: Transformer, keys: list[str], first: bool, last: bool):
        super().__init__()
        self.blocks = nn.ModuleList(model.layers[k] for k in keys)
        self.embedding = model.tok_embeddings if first else None
        self.head = nn.ModuleList([model.norm, model.output]) if last else None
        self.run = functools.partial(model, start_pos=0, layers=keys)  # not a submodule: see above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def _pruned(args: argparse.Namespace, v: int) -> tuple[Transformer, dict[int, list[str]]]:
    """This rank's part of the model cut into pp·v equal stages; the same weights on every call."""
    pp = dist.get_world_size()
    cfg = ModelConfig(n_layers=args.layers, n_heads=args.heads, dim=args.dim, max_seq_len=args.seq,
                      vocab_size=args.vocab)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg)
    keys = prune_to_rank(model, partition_layers(args.layers, pp * v), dist.get_rank(), pp)
    return model, keys


def _batch(args: argparse.Namespace, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (m * args.batch, args.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def ideal_bubble(record: StepRecord, pp: int, v: int) -> float:
    """The bubble of ``record``'s schedule replayed with its mean measured time of every
    (kind, stage) and instant messages."""
    durations: dict[tuple[str, int], list[float]] = {}
    for actions, spans in zip(record.actions, record.intervals, strict=True):
        for a, (start, end) in zip(actions, spans, strict=True):
            durations.setdefault((a.kind, a.stage), []).append(end - start)
    means = {key: statistics.mean(values) for key, values in durations.items()}
    replay = simulate(record.actions, pp, v, stage_times=means)
    return bubble_fraction([[(start, end) for _, start, end in lane] for lane in replay])


class _Ours:
    """Our executor on a fresh pruned model; ``step()`` zeroes gradients, runs one step and keeps its bubble."""

    def __init__(self, args, schedule: str, v: int, m: int, groups: dict[str, dist.ProcessGroup]):
        pp = dist.get_world_size()
        self.model, keys = _pruned(args, v)
        comm = PipelineComm(groups, dist.get_rank(), pp, CPU)
        self.executor = PipelineExecutor(self.model, keys, schedule, m, pp, v, comm)
        x, y = _batch(args, m)
        self.micro_batches = list(zip(x.chunk(m), y.chunk(m), strict=True))
        self.bubbles: list[float] = []
        self.ideal: list[float] = []
        self.pp, self.v = pp, v

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.executor.train_step(self.micro_batches, cross_entropy)
        record = self.executor.last_record
        self.bubbles.append(record.bubble_fraction)
        self.ideal.append(ideal_bubble(record, self.pp, self.v))


class _Peer:
    """torch's schedule over the same stages of its own, identically built model."""

    def __init__(self, args, schedule: str, v: int, m: int, group: dist.ProcessGroup):
        pp, rank = dist.get_world_size(), dist.get_rank()
        self.model, keys = _pruned(args, v)
        n_stages = pp * v
        stages = [
            PipelineStage(_TorchStage(self.model, k, s == 0, s == n_stages - 1), s, n_stages, CPU, group=group)
            for s, k in keys.items()
        ]
        if schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=cross_entropy)
        else:
            self.schedule = TORCH_SCHEDULES[schedule](stages[0], m, loss_fn=cross_entropy)
        # Stage 0 is on rank 0 and the last stage on rank pp − 1 in both placements.
        x, y = _batch(args, m)
        self.inputs = (x,) if rank == 0 else ()
        self.target = y if rank == pp - 1 else None

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.schedule.step(*self.inputs, target=self.target, return_outputs=False)


def _grad_gap(ours: nn.Module, peer: nn.Module) -> float:
    """Largest ‖g_ours − g_torch‖ / ‖g_torch‖ over the parameters of every rank (a collective)."""
    theirs = dict(peer.named_parameters())
    gaps = torch.stack([(p.grad - theirs[n].grad).norm() / theirs[n].grad.norm() for n, p in ours.named_parameters()])
    worst = gaps.nan_to_num(nan=float("inf")).max().reshape(1)  # a zero gradient (0/0) must fail the check
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def bubble_only(args, schedule: str, v: int, m: int, groups) -> dict:
    ours = _Ours(args, schedule, v, m, groups)
    for _ in range(args.steps + 1):
        ours.step()
    # The first step allocates and agrees message shapes.
    return {"bubbles": ours.bubbles[1:], "ideal": ours.ideal[1:]}


def race(args, schedule: str, v: int, m: int, groups, peer_group) -> dict:
    ours, peer = _Ours(args, schedule, v, m, groups), _Peer(args, schedule, v, m, peer_group)
    ours.step()  # warm-up of both, and the check that they compute the same thing
    peer.step()
    gap = _grad_gap(ours.model, peer.model)
    assert gap <= GRAD_RTOL, f"{schedule} pp={dist.get_world_size()} m={m}: gradients differ from torch's by {gap:.2e}"
    ours.bubbles.clear()
    ours.ideal.clear()
    times = interleaved_rounds({"ours": lambda i: ours.step(), "torch": lambda i: peer.step()}, args.rounds,
                               args.race_steps)  # fmt: skip
    return {"bubbles": ours.bubbles, "ideal": ours.ideal, "ours_s": statistics.median(times["ours"]),
            "torch_s": statistics.median(times["torch"]), "grad_rel_gap": gap}  # fmt: skip


def worker(args: argparse.Namespace) -> list[dict]:
    pp = dist.get_world_size()
    everyone = list(range(pp))
    # Our activations and gradients travel on two groups, torch's messages on a third.
    groups = {"activation": dist.new_group(everyone), "gradient": dist.new_group(everyone)}
    peer_group = dist.new_group(everyone)
    racing = pp in args.race_pp
    rows = []
    for schedule in args.schedules:
        v = args.virtual if schedule == "interleaved_1f1b" else 1
        for m in sorted({*args.micro, *([args.race_micro] if racing else [])}):
            if racing and m == args.race_micro:
                result = race(args, schedule, v, m, groups, peer_group)
            else:
                result = bubble_only(args, schedule, v, m, groups)
            measured, theory = statistics.median(result.pop("bubbles")), theoretical_bubble(schedule, pp, m, v)
            ideal = statistics.median(result.pop("ideal"))
            row = {"schedule": schedule, "pp": pp, "v": v, "m": m, "measured_bubble": measured,
                   "theoretical_bubble": theory, "gap_pp": 100 * (measured - theory), "ideal_bubble": ideal,
                   "gap_to_ideal_pp": 100 * (measured - ideal),
                   "ours_s": None, "torch_s": None, "ratio": None, "grad_rel_gap": None}  # fmt: skip
            row.update(result)
            if row["ours_s"] is not None:
                row["ratio"] = row["ours_s"] / row["torch_s"]
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline degrees (= processes)")
    parser.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16], help="micro-batches per step")
    parser.add_argument("--schedules", nargs="+", default=list(TORCH_SCHEDULES), choices=list(TORCH_SCHEDULES))
    parser.add_argument("--virtual", type=int, default=2, help="chunks per rank of interleaved_1f1b")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per bubble case, after one warm-up")
    parser.add_argument("--race-pp", type=int, nargs="*", default=[2, 4], help="pipeline degrees raced against torch")
    parser.add_argument("--race-micro", type=int, default=8, help="micro-batches per step in the race")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--race-steps", type=int, default=2, help="steps per implementation per round")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON result goes")
    args = parser.parse_args()
    for name, value in (("MALLOC_MMAP_THRESHOLD_", str(2**32)), ("MALLOC_TRIM_THRESHOLD_", str(2**36))):
        os.environ.setdefault(name, value)  # read by glibc when each spawned worker starts
    rows = []
    for pp in args.pp:
        rows += spawn(worker, pp, args, timeout_s=1800)[0]
    print(f"{'schedule':>16} {'pp':>2} {'v':>1} {'m':>2} {'bubble':>7} {'theory':>7} {'gap pp':>7} {'ideal':>7} "
          f"{'-ideal':>7}  {'ours s':>7} {'torch s':>7} {'ratio':>5}")  # fmt: skip
    for r in rows:
        times = f"{r['ours_s']:7.3f} {r['torch_s']:7.3f} {r['ratio']:5.3f}" if r["ratio"] is not None else ""
        print(f"{r['schedule']:>16} {r['pp']:>2} {r['v']:>1} {r['m']:>2} {r['measured_bubble']:7.4f} "
              f"{r['theoretical_bubble']:7.4f} {r['gap_pp']:+7.2f} {r['ideal_bubble']:7.4f} "
              f"{r['gap_to_ideal_pp']:+7.2f}  {times}")  # fmt: skip
    worst_gap = max(rows, key=lambda r: abs(r["gap_pp"]))
    raced = [r for r in rows if r["ratio"] is not None]
    summary = {
        "cases": rows,
        "worst_abs_gap_pp": abs(worst_gap["gap_pp"]),
        "worst_ratio": max((r["ratio"] for r in raced), default=None),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "malloc": {k: os.environ[k] for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")},
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    if raced:
        worst = max(raced, key=lambda r: r["ratio"])
        print(f"worst step-time ratio (ours / torch): {worst['ratio']:.3f} ({worst['schedule']}, pp={worst['pp']})")
    print(
        f"worst |measured − theory| bubble gap: {abs(worst_gap['gap_pp']):.2f} percentage points "
        f"({worst_gap['schedule']}, pp={worst_gap['pp']}, m={worst_gap['m']})"
    )


if __name__ == "__main__":
    main()
