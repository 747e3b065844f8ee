"""2D tensor parallelism (Optimus, q × q grid) against Megatron 1D tensor parallelism, with and
without sequence parallelism, at tp = 4 on 4 gloo processes: activation memory, parameter
memory and bytes sent per rank against the formulas of ``docs/tensor_parallel_2d.md``, and the
step time of 1D and 2D.

- Activation memory: the bytes one micro-batch's forward (model and loss) leaves saved for
  backward on a rank, counted exactly with ``SavedTensorCounter``
  (``torch.autograd.graph.saved_tensors_hooks``): each distinct storage once, at its full size,
  parameters and buffers excluded. Whole model (``--layers`` blocks) and one block's share
  (the difference between the ``--layers``-block and the 1-block model, divided by
  ``layers − 1``).
- Parameter memory: bytes of this rank's parameters (its shards; replicated norm weights in full).
- Bytes per layer: ``Traffic``'s count over one forward and backward, per layer as above, all
  axes summed (2D: the grid-row and grid-column axes).
- Step time: forward and backward (no optimizer) of 1D and 2D, interleaved rounds of alternating
  order (``timing.py``), median seconds of the slowest rank; ratio 2D / 1D, next to the ratio of
  bytes per layer and of collectives per layer that the formulas predict.
- Step time on 2 emulated hosts × 2 processes (``loomtrain.cluster``, docs/cluster.md; needs root,
  else skipped with the reason), host links shaped to ``--inter-rate``: ranks 0, 1 on host 0, so
  each grid row is inside a host and only the grid-column (weight-sized) traffic crosses, where
  1D's all-reduces cross with activation-sized messages. A longer micro-batch
  (``--host-batch × --host-seq`` tokens), the regime where 2D sends fewer bytes across.

Every formula figure is per rank and is equal on every rank (the shapes are chosen to split
evenly); the measured figures are rank 0's (the JSON holds every rank's, checked equal).
Writes ``benchmarks/results/tp2d.json`` and prints the 2D / 1D activation-memory ratio last.

    python benchmarks/bench_tp2d.py [--rounds 4 --steps 3 --layers 4 --dim 256 --heads 8
        --kv-heads 4 --vocab 1024 --batch 4 --seq 128 --inter-rate 100mbit --host-batch 8
        --host-seq 256 --host-rounds 2 --host-steps 2 --no-hosts]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from timing import interleaved_rounds

from loomtrain.cluster.emulated import ClusterSpec, emulated_cluster, missing_requirements
from loomtrain.config import ModelConfig
from loomtrain.distributed.activation_checkpoint import SavedTensorCounter
from loomtrain.distributed.spawn import spawn
from loomtrain.distributed.tensor_parallel import vocab_parallel_cross_entropy
from loomtrain.distributed.tensor_parallel_2d import Grid2D, padded_vocab
from loomtrain.distributed.traffic import Traffic
from loomtrain.models import Transformer
from loomtrain.models.parallelize import apply_tensor_parallel
from loomtrain.models.tp2d import parallelize_2d

RESULTS = Path(__file__).resolve().parent / "results" / "tp2d.json"
PORT = 29511  # inside the emulated hosts' own network namespaces: no other job's ports there
WORLD, Q = 4, 2
MODES = ("tensor_parallel", "sequence_parallel", "2d")
FP32, INT64, BOOL = 4, 8, 1


@dataclass(frozen=True)
class Shape:
    """The symbols of the formulas: ``b`` sequences of ``s`` tokens, width ``h``, ``a`` query
    heads, ``k`` key/value width (``n_kv_heads · head_dim``), ``f`` SwiGLU width, ``v``
    vocabulary, ``layers`` blocks, ``t = q²`` tensor-parallel degree."""

    b: int
    s: int
    h: int
    a: int
    k: int
    f: int
    v: int
    layers: int
    t: int = WORLD
    q: int = Q

    @classmethod
    def of(cls, cfg: ModelConfig, b: int) -> Shape:
        """The symbols of ``cfg`` at micro-batch ``b``."""
        return cls(b, cfg.max_seq_len, cfg.dim, cfg.n_heads, cfg.kv_heads * cfg.head_dim, cfg.hidden_dim,
                   cfg.vocab_size, cfg.n_layers)  # fmt: skip

    @property
    def v_pad(self) -> int:
        return padded_vocab(self.v, self.q)

    @property
    def block_weights(self) -> int:
        """Elements of one block's seven weight matrices."""
        return 2 * self.h * self.h + 2 * self.h * self.k + 3 * self.h * self.f


def block_activation_formula(mode: str, d: Shape) -> int:
    """Bytes one block saves for backward on one rank (fp32, ``dropout = 0``, the fused SDPA
    kernel); derived in ``docs/tensor_parallel_2d.md`` ("Activation memory per rank")."""
    b, s, h, a, k, f, t, q = d.b, d.s, d.h, d.a, d.k, d.f, d.t, d.q
    split = 2 * s * b * k + 4 * s * b * f + a * s * b  # k, v; SwiGLU; log-sum-exp: split in every mode
    if mode == "tensor_parallel":
        elements = 6 * s * b * h + 2 * s * b + (2 * s * b * h + split) // t
    elif mode == "sequence_parallel":
        elements = 2 * s * b * h + (6 * s * b * h + 2 * s * b + split) // t
    else:
        elements = (8 * s * b * h + split) // (q * q) + 2 * s * b // q
    return FP32 * elements


def outside_blocks_formula(mode: str, d: Shape) -> int:
    """Bytes the embedding, final norm, head and loss save on one rank (see the docs)."""
    b, s, h, t, q = d.b, d.s, d.h, d.t, d.q
    embedding = (INT64 + BOOL) * b * s  # the looked-up ids and the outside-the-block mask
    if mode == "2d":
        norm_and_head = FP32 * (3 * s * b * h // (q * q) + s * b // q)
        loss = BOOL * d.v_pad // q + FP32 * (b // q) * s * (d.v_pad // q) + (INT64 + BOOL) * (b // q) * s
        return embedding + norm_and_head + loss
    norm = FP32 * (2 * s * b * h + s * b)
    norm = norm // t if mode == "sequence_parallel" else norm
    loss = FP32 * b * s * d.v // t + (INT64 + BOOL) * b * s  # softmax block, target ids, in-block mask
    return embedding + norm + FP32 * s * b * h + loss  # the head keeps its (gathered) input whole


def activation_formula(mode: str, d: Shape) -> int:
    """Bytes the whole model's forward and loss save on one rank."""
    return d.layers * block_activation_formula(mode, d) + outside_blocks_formula(mode, d)


def param_formula(mode: str, d: Shape) -> int:
    """Bytes of one rank's parameters: matrices split ``t`` ways (1D) or ``q²`` ways (2D, the
    vocabulary padded to ``V_pad``); norm weights whole (1D) or ``h/q`` (2D)."""
    norms = (2 * d.layers + 1) * d.h
    if mode == "2d":
        return FP32 * ((d.layers * d.block_weights + 2 * d.v_pad * d.h) // (d.q * d.q) + norms // d.q)
    return FP32 * ((d.layers * d.block_weights + 2 * d.v * d.h) // d.t + norms)


def traffic_formula(mode: str, d: Shape) -> dict[str, int]:
    """Bytes one rank sends per block in forward and backward, per axis (tensor_parallel.md,
    tensor_parallel_2d.md "Per transformer block"; ``e = c = 4``)."""
    m, t, q = d.b * d.s, d.t, d.q
    if mode != "2d":
        norms = 2 * 2 * d.h * (t - 1) // t if mode == "sequence_parallel" else 0
        return {"tp": FP32 * (8 * m * d.h * (t - 1) // t + norms)}
    row = 3 * (q - 1) * m * FP32 * (6 * d.h + d.f) // q**2 + 8 * (q - 1) * m * FP32 // q**2
    col = 3 * (q - 1) * FP32 * d.block_weights // q**2 + 4 * (q - 1) * d.h * FP32 // q**2
    return {"tp_row": row, "tp_col": col}


def collectives_per_block(mode: str, q: int = Q) -> int:
    """Collectives one rank issues per block, forward and backward: 1D, 4 (2 all-reduces or
    all-gather/reduce-scatter pairs each way; sequence parallel adds the 2 norm-weight
    all-reduces); 2D, per GEMM ``2q`` broadcasts forward and ``2q`` broadcasts + ``2q`` reduces
    backward, for 7 GEMMs, plus 2 all-reduces per norm (forward, backward) and its weight's."""
    if mode == "2d":
        return 7 * 6 * q + 2 * 3
    return 4 + (2 if mode == "sequence_parallel" else 0)


def _model_cfg(args: argparse.Namespace, layers: int) -> ModelConfig:
    return ModelConfig(n_layers=layers, n_heads=args.heads, n_kv_heads=args.kv_heads, dim=args.dim,
                       max_seq_len=args.seq, vocab_size=args.vocab)  # fmt: skip


def _build(mode: str, cfg: ModelConfig, grid: Grid2D, traffic: Traffic | None):
    """The sharded model and its loss ``(tokens, target) → scalar`` for ``mode``."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    if mode == "2d":
        par = parallelize_2d(model, grid, traffic)
        return par, par
    group = dist.group.WORLD
    apply_tensor_parallel(model, group, sequence_parallel=mode == "sequence_parallel", traffic=traffic)
    return model, lambda x, y: vocab_parallel_cross_entropy(model(x), y, group, traffic)


def _batch(cfg: ModelConfig, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.max_seq_len + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _count(mode: str, cfg: ModelConfig, grid: Grid2D, b: int) -> dict:
    """Saved bytes of one forward, parameter bytes and bytes sent in forward and backward."""
    traffic = Traffic()
    model, loss_fn = _build(mode, cfg, grid, traffic)
    x, y = _batch(cfg, b)
    with SavedTensorCounter([*model.parameters(), *model.buffers()]) as saved:
        loss = loss_fn(x, y)
    loss.backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"saved": saved.bytes, "params": params, "traffic": traffic.snapshot()}


def measure(args: argparse.Namespace, grid: Grid2D) -> dict:
    """Per mode: measured and formula bytes (activations per block and whole model, parameters,
    traffic per block and axis)."""
    big, one = _model_cfg(args, args.layers), _model_cfg(args, 1)
    d = Shape.of(big, args.batch)
    out = {}
    for mode in MODES:
        full, small = _count(mode, big, grid, args.batch), _count(mode, one, grid, args.batch)
        per = args.layers - 1
        out[mode] = {
            "activation_bytes_per_block": (full["saved"] - small["saved"]) // per,
            "activation_bytes_per_block_formula": block_activation_formula(mode, d),
            "activation_bytes_model": full["saved"],
            "activation_bytes_model_formula": activation_formula(mode, d),
            "param_bytes": full["params"],
            "param_bytes_formula": param_formula(mode, d),
            "traffic_bytes_per_block": {a: (n - small["traffic"].get(a, 0)) // per for a, n in full["traffic"].items()},
            "traffic_bytes_per_block_formula": traffic_formula(mode, d),
            "collectives_per_block": collectives_per_block(mode),
        }
    return out


def time_steps(args: argparse.Namespace, grid: Grid2D, rounds: int, steps: int) -> dict[str, float]:
    """Median forward-and-backward seconds of the slowest rank, 1D and 2D, interleaved."""
    cfg = _model_cfg(args, args.layers)
    x, y = _batch(cfg, args.batch)
    runs = {}
    for mode in ("tensor_parallel", "2d"):
        model, loss_fn = _build(mode, cfg, grid, None)

        def step(_i: int, model=model, loss_fn=loss_fn) -> None:
            loss_fn(x, y).backward()
            model.zero_grad(set_to_none=True)

        step(0)  # warm-up: first-touch allocations
        runs[mode] = step
    times = interleaved_rounds(runs, rounds, steps)
    return {mode: statistics.median(t) for mode, t in times.items()}


def worker(args: argparse.Namespace) -> dict:
    """One rank of the 4-process run (under ``spawn``): the counts of every mode and the step times."""
    grid = Grid2D.from_ranks(range(WORLD))
    return {"measured": measure(args, grid), "step_s": time_steps(args, grid, args.rounds, args.steps)}


def _host_args(args: argparse.Namespace) -> argparse.Namespace:
    out = copy.copy(args)
    out.batch, out.seq = args.host_batch, args.host_seq
    return out


def host_worker(args: argparse.Namespace) -> None:
    """One rank of the emulated-hosts run (started inside its host's namespace); rank 0 writes
    the step times to ``args.out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{PORT}", rank=args.rank,
                            world_size=WORLD, timeout=timedelta(seconds=300))  # fmt: skip
    try:
        step = time_steps(_host_args(args), Grid2D.from_ranks(range(WORLD)), args.host_rounds, args.host_steps)
        if args.rank == 0:
            Path(args.out).write_text(json.dumps(step))
    finally:
        dist.destroy_process_group()


def time_on_hosts(args: argparse.Namespace) -> dict:
    """1D and 2D step seconds on 2 emulated hosts × 2 processes, or why they were not measured.

    Raises:
        RuntimeError: a rank failed or did not finish within 10 minutes (all are killed).
    """
    why_not = missing_requirements()
    if args.no_hosts or why_not:
        return {"skipped": "--no-hosts" if args.no_hosts else why_not}
    with tempfile.TemporaryDirectory(prefix="bench-tp2d-") as work:
        out = Path(work) / "step.json"
        spec = ClusterSpec(hosts=2, procs_per_host=2, inter_rate=args.inter_rate, name="tp2d")
        with emulated_cluster(spec, state_dir=Path(work) / "clusters") as c:
            argv = [sys.executable, __file__, *sys.argv[1:], "--master", c.address(0), "--out", str(out)]
            procs = [c.popen(r // 2, [*argv, "--rank", str(r)], env={"OMP_NUM_THREADS": "1"}) for r in range(WORLD)]
            try:
                codes = [p.wait(timeout=600) for p in procs]
            except subprocess.TimeoutExpired:
                codes = ["timeout"]
            finally:
                for p in procs:
                    p.kill()
        if any(code != 0 for code in codes) or not out.exists():
            raise RuntimeError(f"emulated-hosts run failed (exit codes {codes}); rerun with --no-hosts to skip it")
        step = json.loads(out.read_text())
    shape = {"inter_rate": args.inter_rate, "batch": args.host_batch, "seq": args.host_seq}
    return {**shape, "step_s": step, "ratio_2d_over_1d": step["2d"] / step["tensor_parallel"]}


def _checks(m: dict) -> dict[str, bool]:
    """The issue's targets, on the measured figures."""
    two, one = m["2d"], m["tensor_parallel"]
    exact = all(
        r["traffic_bytes_per_block"] == r["traffic_bytes_per_block_formula"]
        and r["param_bytes"] == r["param_bytes_formula"]
        for r in m.values()
    )
    within = all(abs(two[k] / two[f"{k}_formula"] - 1) <= 0.10 for k in ("activation_bytes_per_block",
                                                                         "activation_bytes_model"))  # fmt: skip
    ratio = two["activation_bytes_per_block"] / one["activation_bytes_per_block"]
    return {"bytes_and_params_equal_formula": exact, "2d_activations_within_10pct_of_formula": within,
            "2d_over_1d_activations_at_most_0.6": ratio <= 0.6}  # fmt: skip


def _print_table(m: dict) -> None:
    for mode, r in m.items():
        sent, want = sum(r["traffic_bytes_per_block"].values()), sum(r["traffic_bytes_per_block_formula"].values())
        print(
            f"{mode:>17}: activations/block {r['activation_bytes_per_block']:>10,} B "
            f"(formula {r['activation_bytes_per_block_formula']:>10,}), model {r['activation_bytes_model']:>11,} B "
            f"(formula {r['activation_bytes_model_formula']:>11,}); params {r['param_bytes']:>10,} B "
            f"(formula {r['param_bytes_formula']:>10,}); sent/block {sent:>10,} B (formula {want:>10,})"
        )


def main() -> None:
    """Parse the flags; run the 4-process measurement, then the emulated hosts; write and print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="blocks of the model (at least 2)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--inter-rate", default="100mbit", help="host link rate of the emulated hosts (tc units)")
    parser.add_argument("--host-batch", type=int, default=8, help="micro-batch of the emulated-hosts run")
    parser.add_argument("--host-seq", type=int, default=256, help="sequence length of the emulated-hosts run")
    parser.add_argument("--host-rounds", type=int, default=2)
    parser.add_argument("--host-steps", type=int, default=2)
    parser.add_argument("--no-hosts", action="store_true", help="skip the emulated-hosts step time")
    for hidden in ("--master", "--out"):  # set by time_on_hosts for the ranks it starts
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        host_worker(args)
        return
    if args.layers < 2:
        parser.error("--layers must be at least 2: one block's share is the difference from a 1-block model")
    results = spawn(worker, WORLD, args, timeout_s=600)
    hosts = time_on_hosts(args)
    m, step = results[0]["measured"], results[0]["step_s"]
    same = all(r["measured"] == m for r in results)
    one, two, sp = m["tensor_parallel"], m["2d"], m["sequence_parallel"]
    ratios = {
        "activations_per_block_2d_over_1d": two["activation_bytes_per_block"] / one["activation_bytes_per_block"],
        "activations_model_2d_over_1d": two["activation_bytes_model"] / one["activation_bytes_model"],
        "activations_per_block_2d_over_1d_sp": two["activation_bytes_per_block"] / sp["activation_bytes_per_block"],
        "params_2d_over_1d": two["param_bytes"] / one["param_bytes"],
        "bytes_per_block_2d_over_1d": sum(two["traffic_bytes_per_block"].values())
        / sum(one["traffic_bytes_per_block"].values()),
        "collectives_per_block_2d_over_1d": two["collectives_per_block"] / one["collectives_per_block"],
        "step_time_2d_over_1d": step["2d"] / step["tensor_parallel"],
    }
    summary = {"tp": WORLD, "q": Q, "modes": m, "every_rank_measured_the_same": same, "checks": _checks(m),
               "step_time_s": step, "ratios": ratios, "emulated_hosts": hosts,
               "per_rank": [r["measured"] for r in results], "config": vars(args)}  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2))
    _print_table(m)
    print(f"checks: {summary['checks']}, every rank the same: {same}")
    print(f"step (forward + backward): 1D {step['tensor_parallel']:.4f} s, 2D {step['2d']:.4f} s, "
          f"2D / 1D {ratios['step_time_2d_over_1d']:.2f}; the formulas: 2D sends "
          f"{ratios['bytes_per_block_2d_over_1d']:.2f}x the bytes in "
          f"{ratios['collectives_per_block_2d_over_1d']:.0f}x the collectives per block")  # fmt: skip
    if "skipped" in hosts:
        print(f"2 emulated hosts: skipped ({hosts['skipped']})")
    else:
        print(f"2 emulated hosts x 2 processes, {hosts['inter_rate']} links, b={hosts['batch']} s={hosts['seq']}: "
              f"1D {hosts['step_s']['tensor_parallel']:.3f} s, 2D {hosts['step_s']['2d']:.3f} s, "
              f"2D / 1D {hosts['ratio_2d_over_1d']:.2f}")  # fmt: skip
    print(f"2D / 1D+SP activation memory per block: {ratios['activations_per_block_2d_over_1d_sp']:.3f}")
    print(f"2D / 1D activation memory per rank: {ratios['activations_per_block_2d_over_1d']:.3f} per block, "
          f"{ratios['activations_model_2d_over_1d']:.3f} whole model")  # fmt: skip


if __name__ == "__main__":
    main()
