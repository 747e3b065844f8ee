"""Data parallelism: bucketed gradient all-reduce, overlapped with the backward pass.

The algorithm is the one described by Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training" (VLDB 2020), §3.2: parameters are grouped into buckets
of about ``bucket_size_mb`` in reverse registration order (roughly the order in which
backward produces their gradients); when every gradient of a bucket has been accumulated,
the bucket's reduction is launched asynchronously, so communication runs while backward
computes earlier layers. The optimizer waits for all buckets only just before it steps.

Each parameter's ``.grad`` becomes a view into its bucket's flat buffer, so gradients are
accumulated in place and need no copy before or after communication.

All reductions go through a :class:`CommHook`, the one seam where compression and
hierarchical collectives plug in. :class:`GradientSynchronizer` implements the gradient-sync
protocol of ``sync.py``.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from loomtrain.distributed.clip import NormLayout
from loomtrain.distributed.sync import GradientSync, model_state_bytes
from loomtrain.distributed.traffic import GRADIENT_AXIS, Traffic, all_reduce_bytes, reduce_scatter_bytes

log = logging.getLogger(__name__)


@dataclass
class GradBucket:
    """A contiguous group of gradients reduced by one collective.

    Attributes:
        index: position in launch order (0 = first launched, holds the last layers).
        buffer: flat 1-D tensor of ``sum(p.numel())`` elements, the gradients back to back.
        params: the parameters whose gradients live in ``buffer``.
        names: their qualified names, for error messages.
        offsets: element offset of each parameter's gradient in ``buffer``.
        matrices: each gradient as a view of ``buffer`` whose leading dimensions flatten to
            the rows of a matrix and whose last one holds its columns, for hooks that compress
            per matrix (PowerSGD). Derived from ``params`` as ``[dim0, numel/dim0]`` when not
            given; ZeRO, whose buffers have no ``params``, passes ``[n, rows, row_numel]``
            views of its rank-major layout.
    """

    index: int
    buffer: torch.Tensor
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    ready: set[int] = field(default_factory=set)
    matrices: list[torch.Tensor] = field(default_factory=list)
    views: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        # Built once: the hooks run on every backward and must stay cheap.
        self.views = [
            self.buffer[off : off + p.numel()].view_as(p) for off, p in zip(self.offsets, self.params, strict=True)
        ]
        if not self.matrices:
            self.matrices = [v.view(v.shape[0] if v.dim() else 1, -1) for v in self.views]

    def grad_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient inside ``buffer``, shaped like the parameter."""
        return self.views[i]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class Pending:
    """A reduction in flight: ``wait()`` waits for the collective, then runs ``finish`` (the
    decoding) on the caller's thread and returns its tensor. A callback chained on the
    collective's future would run on the communication thread instead, contending for the
    GIL with backward, and any collective it issued could interleave differently per rank."""

    def __init__(self, work: dist.Work | None, finish: Callable[[], torch.Tensor]):
        self.work = work
        self.finish = finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
        """The same reduction followed by ``fn`` applied to its result."""
        return Pending(self.work, lambda: fn(self.finish()))


class CommHook(ABC):
    """Reduces one bucket's gradients across the data-parallel group.

    Subclasses implement :meth:`reduce` (and may override :meth:`reduce_scatter`, which ZeRO
    stages 2 and 3 call instead). A hook may keep state (error-feedback residuals,
    for instance); :meth:`state_dict`/:meth:`load_state_dict` carry it into checkpoints.
    ``method`` names the compression method (``compression.method``), so a checkpoint's state
    is only loaded into a hook of the same kind.
    ``bytes_sent`` counts the bytes this rank put on the wire, summed over calls, in
    :attr:`traffic` under the ``"dp"`` axis (:meth:`count_into` shares the model's counter, so
    gradient bytes sit beside the tp, sp and pp ones); ``dense_bytes`` what the uncompressed
    all-reduce (or reduce-scatter) of the same buffers would have sent, so
    ``bytes_sent / dense_bytes`` is the compression ratio.
    The synchronizers call :meth:`on_step_end` once per optimizer step, after every reduction
    of the step has finished; ``steps`` counts those calls (compressors warm up on it).
    """

    method = "none"
    # Whether the hook counts the bytes that crossed hosts under traffic.INTER_HOST_AXIS.
    counts_inter_host = False

    def __init__(self) -> None:
        self.traffic = Traffic()
        self.dense_bytes = 0
        self.steps = 0

    @property
    def bytes_sent(self) -> int:
        return self.traffic.bytes[GRADIENT_AXIS]

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        self.traffic.bytes[GRADIENT_AXIS] = value

    def count_into(self, traffic: Traffic) -> None:
        """Count this hook's bytes in ``traffic`` (the model's per-axis counter) from now on,
        carrying over what it counted so far."""
        traffic.bytes[GRADIENT_AXIS] += self.bytes_sent
        self.traffic = traffic

    def setup(self, groups: list[list[int]]) -> None:
        """Called collectively by every rank of the world, before the first reduction, with the
        global ranks of every gradient group (every rank passes the same list). Hooks that need
        subgroups create them here with ``dist.new_group``, in the same order on every rank
        (see ``collectives.HierarchicalHook``). Nothing by default."""
        del groups

    @abstractmethod
    def reduce(self, bucket: GradBucket, group: dist.ProcessGroup) -> torch.futures.Future:
        """Start the reduction of ``bucket.buffer``; the future's value is the averaged
        gradient shaped like ``bucket.buffer`` (it may be the buffer itself), as a tensor or a
        one-element list of it (what a collective's own future holds). Any handle whose
        ``wait()`` returns that value will do (compressing hooks finish decoding in ``wait``)."""

    def reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup, bucket: GradBucket | None = None
    ) -> dist.Work:
        """Start the averaged reduce-scatter used by ZeRO stages 2 and 3 (see ``zero.py``).

        ``flat`` is 1-D with ``n·k`` elements for ``n`` ranks, rank ``r``'s part being
        ``flat[r·k:(r+1)·k]``; ``out`` has ``k`` elements; ``bucket`` wraps ``flat`` with its
        index and per-parameter ``matrices`` (for hooks that keep state per bucket). Returns a
        handle with ``wait()`` (a collective's ``Work``; gloo's reduce-scatter has no future);
        once it returns, ``out`` holds this rank's averaged part. The default divides by ``n``
        (in place) and runs a sum reduce-scatter; ``bytes_sent`` grows by the ring volume
        (n−1)/n of ``flat``.
        """
        del bucket
        n = dist.get_world_size(group)
        flat.div_(n)
        nbytes = reduce_scatter_bytes(flat.numel() * flat.element_size(), n)
        self.bytes_sent += nbytes
        self.dense_bytes += nbytes
        return dist.reduce_scatter_single(out, flat, group=group, async_op=True)

    def _dense_average(self, tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool) -> dist.Work | None:
        """Average ``tensor`` in place over ``group``: divide by its size, then a sum all-reduce;
        ``bytes_sent`` and ``dense_bytes`` grow by the ring volume, 2·(n−1)/n of the tensor."""
        n = dist.get_world_size(group)
        tensor.div_(n)
        nbytes = all_reduce_bytes(tensor.numel() * tensor.element_size(), n)
        self.bytes_sent += nbytes
        self.dense_bytes += nbytes
        return dist.all_reduce(tensor, group=group, async_op=async_op)

    def average_replicas(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Average ``tensor`` (in place, blocking) over the replica groups of HSDP: ZeRO's
        reduced gradient shard, which ranks at the same shard position hold, one per replica
        group. Dense by default."""
        self._dense_average(tensor, group, async_op=False)

    def on_step_end(self) -> None:
        """Called once per optimizer step, after all of its reductions finished."""
        self.steps += 1

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


class AllReduceHook(CommHook):
    """Average by dividing by the group size, then a sum all-reduce (in place).

    ``bytes_sent`` uses the ring algorithm's volume, 2·(n−1)/n of the buffer per rank
    (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms", 2009).
    """

    def reduce(self, bucket: GradBucket, group: dist.ProcessGroup) -> torch.futures.Future:
        # The collective's own future (value: [buffer]); chaining a Python callback with
        # .then() would run it on the communication thread, contending for the GIL with backward.
        return self._dense_average(bucket.buffer, group, async_op=True).get_future()


def build_buckets(module: nn.Module, bucket_size_bytes: int) -> list[GradBucket]:
    """Group trainable parameters into buckets of at most ``bucket_size_bytes`` bytes
    (a parameter larger than that gets a bucket of its own), in reverse registration order,
    one dtype and device per bucket."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    buckets: list[GradBucket] = []
    group: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, p in reversed(named):
        nbytes = p.numel() * p.element_size()
        if group and (size + nbytes > bucket_size_bytes or p.dtype != group[0][1].dtype):
            buckets.append(_make_bucket(len(buckets), group))
            group, size = [], 0
        group.append((name, p))
        size += nbytes
    if group:
        buckets.append(_make_bucket(len(buckets), group))
    return buckets


def _make_bucket(index: int, group: list[tuple[str, nn.Parameter]]) -> GradBucket:
    offsets, total = [], 0
    for _, p in group:
        offsets.append(total)
        total += p.numel()
    first = group[0][1]
    buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
    return GradBucket(index, buffer, [p for _, p in group], [n for n, _ in group], offsets)


class GradientSynchronizer(GradientSync):
    """Owns the buckets and hooks that :func:`apply_data_parallel` installs on a module; driven
    through the protocol of :class:`~loomtrain.distributed.sync.GradientSync`.

    ``norm``: where the other pieces of the gradient live when the model is also tensor or
    pipeline parallel, for the global norm of clipping.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, bucket_size_bytes: int, hook: CommHook,
                 norm: NormLayout | None = None):  # fmt: skip
        super().__init__(hook, group, next(module.parameters()).device)
        # Registration order: the norm's sum of squares runs in it, as torch's clip_grad_norm_ does.
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.norm = norm or NormLayout()
        self.buckets = build_buckets(module, bucket_size_bytes)
        self._next_launch = 0
        self._futures: list[torch.futures.Future] = []
        self._warned_unused = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._grad_ready_callback(b, i))
            for b in self.buckets
            for i, p in enumerate(b.params)
        ]

    def _grad_ready_callback(self, bucket: GradBucket, i: int):
        def on_ready(p: nn.Parameter) -> None:
            self.overlap.poll()
            view = bucket.grad_view(i)
            if p.grad.data_ptr() != view.data_ptr():
                # A fresh .grad (first backward, or grads were set to None): adopt the
                # bucket view so later accumulation and the all-reduce act in place.
                view.copy_(p.grad)
                p.grad = view
            if not self._sync:
                return
            if i in bucket.ready:
                raise RuntimeError(
                    f"gradient of {bucket.names[i]} was produced twice in one synchronized step; "
                    "run all micro-batches but the last under no_sync(), then finish_gradient_sync()"
                )
            bucket.ready.add(i)
            self._launch_ready_buckets()

        return on_ready

    def _launch_ready_buckets(self) -> None:
        # Buckets are launched strictly in index order so every rank issues the collectives
        # in the same sequence, whatever order its hooks fire in.
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: GradBucket) -> None:
        start = time.perf_counter()
        self._futures.append(self.hook.reduce(bucket, self.group))
        self.overlap.launched(self._futures[-1], start)
        self._next_launch += 1

    def finish_gradient_sync(self) -> None:
        """Launch buckets still waiting for unused parameters, then wait for every reduction.

        A parameter that got no gradient in this step contributes zeros (its view holds
        whatever earlier micro-batches accumulated, zero if none); it is named once in a
        warning. Afterwards every parameter's ``.grad`` is the rank-averaged gradient.
        """
        self.overlap.compute_ended()
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            self._adopt_missing(bucket)
            self._launch(bucket)
        for bucket, fut in zip(self.buckets, self._futures, strict=True):
            reduced = fut.wait()
            if isinstance(reduced, list):
                reduced = reduced[0]
            if reduced is not bucket.buffer:
                bucket.buffer.copy_(reduced)
            bucket.ready.clear()
        self._futures.clear()
        self._next_launch = 0
        self.hook.on_step_end()
        self.overlap.synced()

    def _adopt_missing(self, bucket: GradBucket) -> None:
        missing = [i for i in range(len(bucket.params)) if i not in bucket.ready]
        for i in missing:
            p = bucket.params[i]
            view = bucket.grad_view(i)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        if missing and not self._warned_unused:
            self._warned_unused = True
            names = ", ".join(bucket.names[i] for i in missing)
            log.warning("parameters without a gradient this step (reduced as zeros): %s", names)

    def prepare_step(self, max_norm: float) -> bool:
        """Clip the averaged gradients to global L2 norm ``max_norm`` (``<= 0``: leave them);
        plain data parallelism has no loss scaling, so the step always runs."""
        if max_norm > 0:
            self.norm.clip(self._named_grads(), max_norm)
        return True

    def _named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """The gradients for the norm: per parameter where tensor parallelism sorts them by name,
        else the buckets, which hold every gradient back to back (after
        :meth:`finish_gradient_sync` each ``.grad`` is a view of one): the same norm and
        scaling with a few kernels per bucket instead of per parameter."""
        if self.norm.tp_sharded:
            return [(n, p.grad) for n, p in self.named_params]
        return [(f"bucket {b.index}", b.buffer) for b in self.buckets]

    def after_step(self) -> None:
        """Nothing to do: the optimizer updated the parameters the module computes with."""

    def zero_grad(self) -> None:
        """Zero every bucket in place (the ``.grad`` views stay bound)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def state_bytes(self) -> dict[str, int]:
        """Parameters, gradient buckets and optimizer state held by this rank (distinct storages)."""
        params = [p for _, p in self.named_params]
        return model_state_bytes(params, [p.grad for p in params], self.optimizer)

    def remove(self) -> None:
        """Detach the hooks from the module."""
        for h in self._handles:
            h.remove()


def broadcast_module(module: nn.Module, group: dist.ProcessGroup, src_rank: int = 0) -> None:
    """Copy parameters and buffers from the group's rank ``src_rank`` to all ranks, one
    broadcast per dtype (flattened) rather than one per tensor."""
    tensors = [t for t in (*module.parameters(), *module.buffers())]
    src = dist.get_global_rank(group, src_rank)
    for dtype in {t.dtype for t in tensors}:
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def apply_data_parallel(
    module: nn.Module,
    group: dist.ProcessGroup,
    bucket_size_mb: float = 25.0,
    hook: CommHook | None = None,
    **norm_layout,
) -> GradientSynchronizer:
    """Make ``module`` data parallel over ``group``, in place.

    Broadcasts rank 0's parameters and buffers, then installs the bucketed, overlapped
    gradient reduction. ``bucket_size_mb`` is in MiB (2**20 bytes). ``norm_layout``:
    the fields of :class:`~loomtrain.distributed.clip.NormLayout` (``tp_sharded``, ``tp_group``,
    ``pp_group``, ``replicated_group``), for the global gradient norm when the model is also
    tensor or pipeline parallel.

    Returns:
        The :class:`GradientSynchronizer` that the training loop drives.
    """
    broadcast_module(module, group)
    return GradientSynchronizer(module, group, int(bucket_size_mb * 2**20), hook or AllReduceHook(),
                                NormLayout(**norm_layout))  # fmt: skip
