"""Search over parallel layouts: every (dp_replicate, dp_shard with ZeRO stage, tp, Megatron SP, Ulysses
sp, pp, virtual stages, micro-batch, recomputation) of a model on a cluster that fits memory, ranked by
the time model's predicted step time.

Enumeration (``world`` GPUs, global batch ``B`` sequences): ``tp``, ``sp`` and ``pp`` powers of two
(``pp`` also any divisor of the layer count) whose product divides ``world``, ``dp`` the rest; ``B``
must divide by ``dp · b``. ``pp > 1`` runs 1F1B, or the interleaved schedule with ``v`` in 2, 4 when
the micro-batches are a multiple of ``pp`` (Megatron-LM's condition, Narayanan et al. §2.2.2); ZeRO
stages 0-3, and for stage 3 also HSDP (``dp_replicate > 1``, the shard group inside a host). A layout
is rejected with a reason (:data:`REASONS`); the survivors are priced by
:func:`~loomtrain.planner.time.step_time`. Cost: the time of a block depends only on (``tp``, ``sp``,
``b``, recomputation), so it is computed once per such tuple (``time.layer_seconds`` is cached), and
memory is checked before time.
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, replace

from loomtrain.planner.arch import Architecture
from loomtrain.planner.memory import MIXED_ADAM, RECOMPUTE, Layout, Precision, estimate
from loomtrain.planner.time import Cluster, StepTime, flops_per_step, step_time

# Why a layout was rejected. The first four are counted per (tp, sp[, pp[, b]]) shape, before the
# layouts of a shape are made; "interleave" per shape and virtual-stage count; "memory" per layout.
REASONS = {
    "heads": "tp·sp does not divide the attention or key/value heads (or tp the MLP width) [shapes]",
    "layers": "more pipeline stages than layers [shapes]",
    "batch": "the global batch does not divide by dp·micro_batch [shapes]",
    "sequence": "sp does not divide the sequence length [shapes]",
    "interleave": "interleaved schedule needs the micro-batches to be a multiple of pp [shapes × virtual stages]",
    "memory": "predicted memory above the usable share of the device [layouts]",
}
MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL_STAGES = (2, 4)


@dataclass(frozen=True)
class Plan:
    """One priced layout.

    Attributes:
        layout: the :class:`~loomtrain.planner.memory.Layout`.
        memory_bytes: predicted bytes on the fullest device (pipeline rank 0).
        step: the predicted :class:`~loomtrain.planner.time.StepTime`.
        tokens_per_s: ``B · s`` over the step time.
        mfu: model FLOPs (no recomputation) per second over the GPUs' datasheet bf16 peak.
    """

    layout: Layout
    memory_bytes: float
    step: StepTime
    tokens_per_s: float
    mfu: float


@dataclass(frozen=True)
class SearchResult:
    """The ranked plans (fastest first), the rejections by reason and the layouts considered."""

    plans: list[Plan]
    rejected: dict[str, int]
    considered: int


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def _divides_heads(arch: Architecture, tp: int, sp: int) -> bool:
    return not (arch.n_heads % (tp * sp) or arch.n_kv_heads % (tp * sp) or arch.ffn_hidden % tp)


def _pipeline_options(arch: Architecture, pp: int, n_micro: int) -> list[tuple[str, int]]:
    """``(schedule, v)`` options for ``pp`` stages: 1F1B, and interleaved for each ``v`` whose ``pp·v``
    divides the layers (``n_micro`` is checked by the caller, to count the rejection)."""
    found = [("1f1b", 1)]
    if pp == 1:
        return found
    found += [("interleaved_1f1b", v) for v in VIRTUAL_STAGES if arch.n_layers % (pp * v) == 0]
    return found


def model_flops(arch: Architecture, layout: Layout) -> float:
    """FLOPs of one step without recomputation (what MFU counts: Chowdhery et al. 2022 App. B)."""
    return flops_per_step(arch, replace(layout, recompute="none"))


def _shapes(arch: Architecture, world: int, batch: int, seq_len: int,
            counts: collections.Counter) -> list[tuple[int, ...]]:  # fmt: skip
    """``(tp, sp, pp, dp, b)`` tuples that divide ``world``, the batch and (``sp``) the sequence;
    counts the rejected ones."""
    shapes = []
    for tp in _powers_of_two(min(world, arch.n_heads)):
        for sp in _powers_of_two(min(world // tp, arch.n_heads // tp)):
            if world % (tp * sp):  # e.g. tp = 2 on 3 GPUs: not a layout of this world
                continue
            if not _divides_heads(arch, tp, sp):
                counts["heads"] += 1
                continue
            if seq_len % sp:
                counts["sequence"] += 1
                continue
            rest = world // (tp * sp)
            # Powers of two (uneven stages allowed), and the divisors of the layer count (even stages).
            even = {p for p in range(1, min(rest, arch.n_layers) + 1) if rest % p == 0 and arch.n_layers % p == 0}
            for pp in sorted(set(_powers_of_two(rest)) | even):
                if rest % pp:
                    continue
                if pp > arch.n_layers:
                    counts["layers"] += 1
                    continue
                dp = rest // pp
                for b in MICRO_BATCHES:
                    if batch % (dp * b):
                        counts["batch"] += 1
                        continue
                    shapes.append((tp, sp, pp, dp, b))
    return shapes


def _variants(arch: Architecture, shape: tuple[int, ...], batch: int, seq_len: int, precision: Precision,
              cluster: Cluster, counts: collections.Counter, log_interval: int) -> list[Layout]:  # fmt: skip
    """Every Layout of one shape: schedules, ZeRO stages (and HSDP at stage 3), SP, recomputation."""
    tp, sp, pp, dp, b = shape
    n_micro = batch // (dp * b)
    zeros = [(0, 1)] if dp * sp == 1 else [(z, 1) for z in range(4)]  # ZeRO shards over dp · sp
    in_host = max(1, cluster.devices_per_host // (tp * sp))
    if dp > in_host > 1 and dp % in_host == 0:
        zeros.append((3, dp // in_host))
    layouts = []
    for schedule, v in _pipeline_options(arch, pp, n_micro):
        if v > 1 and n_micro % pp:
            counts["interleave"] += 1
            continue
        seq_pars = (False, True) if tp > 1 else (False,)
        for (zero, replicate), recompute, seq_par in itertools.product(zeros, RECOMPUTE, seq_pars):
            layouts.append(Layout(seq_len=seq_len, micro_batch=b, dp=dp, tp=tp, pp=pp, sp=sp, dp_replicate=replicate,
                                  sequence_parallel=seq_par, zero_stage=zero, n_micro=n_micro, schedule=schedule,
                                  virtual_stages=v, recompute=recompute, precision=precision,
                                  log_interval=log_interval))  # fmt: skip
    return layouts


def search(arch: Architecture, cluster: Cluster, global_batch: int, seq_len: int | None = None,
           world: int | None = None, precision: Precision = MIXED_ADAM, memory_fraction: float = 0.9,
           top: int | None = None, log_interval: int = 0) -> SearchResult:  # fmt: skip
    """Every layout of ``arch`` on ``world`` GPUs of ``cluster`` (default: all of them) for
    ``global_batch`` sequences of ``seq_len`` tokens (default: ``arch.max_seq_len``), ranked by step time.

    ``memory_fraction``: the share of device memory the predicted bytes may fill; the rest is left
    for what the memory model leaves out (CUDA context, allocator fragmentation, communication
    buffers, ZeRO-3 gathered layers: docs/planner.md). ``log_interval``: loomtrain's trainer logs
    every so many steps, each logged step's collectives priced (``Layout.log_interval``; 0: none).

    Returns: the plans, the rejections by reason, and ``considered``: the layouts built (priced or
    refused for memory; the other reasons refuse whole shapes before their layouts are built).

    Raises:
        ValueError: no GPU count (``world`` not given and the cluster has no hosts), more GPUs than the
            cluster has, a global batch below 1, a sequence longer than ``arch.max_seq_len``, or a
            negative ``log_interval`` (from :class:`~loomtrain.planner.memory.Layout`).
    """
    world = world or cluster.gpus
    if world < 1 or global_batch < 1:
        raise ValueError(f"--gpus={world} and --global-batch={global_batch} must be at least 1")
    if cluster.gpus and world > cluster.gpus:
        raise ValueError(f"--gpus={world} is more than the cluster's {cluster.gpus}; use at most {cluster.gpus}")
    seq_len = seq_len or arch.max_seq_len
    if not 1 <= seq_len <= arch.max_seq_len:
        raise ValueError(f"--seq-len={seq_len} must be in 1..{arch.max_seq_len}, the model's max_seq_len "
                         "(its positions); raise model.max_seq_len in a config to plan longer sequences")  # fmt: skip
    limit = memory_fraction * cluster.device.memory_bytes
    counts: collections.Counter = collections.Counter()
    plans, considered = [], 0
    for shape in _shapes(arch, world, global_batch, seq_len, counts):
        for layout in _variants(arch, shape, global_batch, seq_len, precision, cluster, counts, log_interval):
            considered += 1
            memory = estimate(arch, layout).total
            if memory > limit:
                counts["memory"] += 1
                continue
            st = step_time(arch, layout, cluster)
            tokens = global_batch * seq_len
            mfu = model_flops(arch, layout) / (st.total * world * cluster.device.peak_flops_per_s)
            plans.append(Plan(layout, memory, st, tokens / st.total, mfu))
    # Equal predicted times (recomputation or ZeRO's extra gathers hidden under communication or
    # compute, say): less recomputation, then a lower ZeRO stage (less communication), then less
    # memory first; the model does not price their contention for the same cores and links.
    plans.sort(key=lambda p: (p.step.total, RECOMPUTE.index(p.layout.recompute), p.layout.zero_stage,
                              p.memory_bytes))  # fmt: skip
    return SearchResult(plans[:top] if top else plans, dict(counts), considered)
