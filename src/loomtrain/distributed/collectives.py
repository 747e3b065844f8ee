"""Two-level (hierarchical) collectives, and the communication hooks that use them.

A group of ``n = H·P`` ranks on ``H`` hosts with ``P`` ranks each splits into one *intra* group
per host (its ``P`` ranks; a rank's *local index* is its position among them, ascending) and
one *inter* group per local index (the ``H`` ranks holding that index, one per host). The
all-reduce becomes reduce-scatter inside each host, all-reduce of the ``1/P`` shards across
hosts (``P`` rings in parallel, each carrying ``1/P`` of the data), all-gather inside each host:
the scheme of Horovod's hierarchical all-reduce (``HOROVOD_HIERARCHICAL_ALLREDUCE``; Sergeev &
Del Balso, "Horovod: fast and easy distributed deep learning in TensorFlow", 2018) and of the
2D-torus all-reduce (Mikami et al., "Massively Distributed SGD: ImageNet/ResNet-50 Training in
a Flash", 2018). The all-to-all is the two-level exchange of DeepSpeed-MoE's hierarchical
all-to-all (Rajbhandari et al., ICML 2022): an all-to-all inside the host gathers on each rank
what its host sends to the ranks of its local index, then one all-to-all across hosts carries
it in ``H − 1`` large messages per rank instead of ``(H − 1)·P`` small ones.

Every function here sums like torch's collective on the flat group of all ``n`` ranks (whose
rank order is ascending global rank), and gives its result exactly, for any placement of
ranks on hosts.

Hooks: :class:`HierarchicalHook` reduces gradient buckets that way, with any other
:class:`~loomtrain.distributed.data_parallel.CommHook` (dense or compressing) reducing only
the shard that crosses hosts; :class:`AutoHook` picks flat or hierarchical per bucket from
:class:`CostModel`, an alpha-beta model of the measured :class:`Topology`.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from loomtrain.distributed.data_parallel import AllReduceHook, CommHook, GradBucket, Pending
from loomtrain.distributed.topology import Topology
from loomtrain.distributed.traffic import (
    INTER_HOST_AXIS,
    Traffic,
    all_gather_bytes,
    all_reduce_bytes,
    reduce_scatter_bytes,
)

log = logging.getLogger(__name__)

FLAT, HIERARCHICAL = "flat", "hierarchical"
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


# ---------------------------------------------------------------------------- groups


def split_by_host(topology: Topology, ranks: Sequence[int]) -> list[list[int]]:
    """The ranks of ``ranks`` on each host of ``topology`` that holds any, ascending, hosts in
    the topology's order (by lowest rank).

    Raises:
        ValueError: a rank on no host of the topology.
    """
    per_host: dict[int, list[int]] = {}
    for r in sorted(ranks):
        per_host.setdefault(topology.host_of(r), []).append(r)
    return [per_host[h] for h in sorted(per_host)]


@dataclass(frozen=True)
class HostGroups:
    """One rank's view of ``H`` hosts × ``P`` ranks: its intra and inter process groups.

    Attributes:
        hosts: global ranks per host, each ascending, hosts ordered by their lowest rank.
        intra: the ranks of this rank's host (``P``).
        inter: the ranks with this rank's local index, one per host (``H``).
        rank: this rank's global rank.
    """

    hosts: tuple[tuple[int, ...], ...]
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    rank: int

    @property
    def num_hosts(self) -> int:
        """``H``: the number of hosts."""
        return len(self.hosts)

    @property
    def procs_per_host(self) -> int:
        """``P``: ranks per host."""
        return len(self.hosts[0])

    @cached_property
    def local_index(self) -> int:
        """This rank's position on its host (its group rank in :attr:`intra`)."""
        return next(h.index(self.rank) for h in self.hosts if self.rank in h)

    def inter_ranks(self, local: int) -> list[int]:
        """The inter group of local index ``local``, in its group-rank order (ascending)."""
        return sorted(h[local] for h in self.hosts)

    @cached_property
    def _flat_position(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(sorted(r for h in self.hosts for r in h))}

    @cached_property
    def chunk_order(self) -> torch.Tensor:
        """int64 ``[n]``: the flat position of each chunk in local-index-major order (local
        index ``l``, then inter-group rank ``j``), the order in which the intra-host
        reduce-scatter must see chunks for inter group ``l`` to receive block ``l``."""
        pos = self._flat_position
        order = [pos[r] for local in range(self.procs_per_host) for r in self.inter_ranks(local)]
        return torch.tensor(order, dtype=torch.int64)

    @cached_property
    def all_to_all_sources(self) -> torch.Tensor:
        """int64 ``[n]``: the flat position of the sender of each chunk this rank holds after
        the two all-to-all steps (inter-group rank ``j`` of the sender's host, then its local
        index)."""
        pos, host_of = self._flat_position, {r: h for h in self.hosts for r in h}
        order = [pos[sender] for peer in self.inter_ranks(self.local_index) for sender in host_of[peer]]
        return torch.tensor(order, dtype=torch.int64)


def new_host_groups(hosts: Sequence[Sequence[int]]) -> HostGroups | None:
    """Create the intra-host and inter-host process groups of ranks laid out as ``hosts``.

    A collective of the default group, as ``dist.new_group`` is: every rank calls it with the
    same ``hosts``, and it creates the ``H`` intra groups, then the ``P`` inter groups, in that
    order.

    Args:
        hosts: the global ranks on each host (any order; normalised as :attr:`HostGroups.hosts`).
    Returns:
        This rank's :class:`HostGroups`, or ``None`` when it is on none of ``hosts``.
    Raises:
        ValueError: hosts of different sizes, an empty host, or a rank listed twice.
    """
    layout = tuple(sorted(tuple(sorted(h)) for h in hosts))
    if not layout or len({len(h) for h in layout}) != 1 or not layout[0]:
        raise ValueError(f"hosts {layout} must be non-empty and hold the same number of ranks each")
    ranks = [r for h in layout for r in h]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"hosts {layout} list a rank twice")
    intra = [dist.new_group(list(h)) for h in layout]
    inter = [dist.new_group(sorted(h[local] for h in layout)) for local in range(len(layout[0]))]
    me = dist.get_rank()
    for i, host in enumerate(layout):
        if me in host:
            return HostGroups(layout, intra[i], inter[host.index(me)], me)
    return None


# ---------------------------------------------------------------------------- shard plans


@dataclass(frozen=True)
class ShardPlan:
    """How a flat buffer of ``bounds[-1]`` elements is cut into ``P`` contiguous pieces for the
    intra-host reduce-scatter: piece ``i`` is ``[bounds[i], bounds[i+1])``, padded with zeros
    to :attr:`width` elements on the wire.

    Attributes:
        bounds: ``P + 1`` element offsets, non-decreasing, from 0 to the buffer's length.
        runs: for row-aligned plans, each maximal run of consecutive rows of one matrix that
            are adjacent in the buffer, as ``(start, rows, cols)`` (element offsets), in matrix
            order; ``None`` for an even split (pieces are then single rows).
    """

    bounds: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...] | None = None

    @property
    def parts(self) -> int:
        """``P``: the number of pieces."""
        return len(self.bounds) - 1

    @property
    def numel(self) -> int:
        """Elements of the buffer cut."""
        return self.bounds[-1]

    @cached_property
    def width(self) -> int:
        """Elements per piece on the wire: the longest piece."""
        return max(b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False))

    @property
    def uniform(self) -> bool:
        """Whether all pieces have :attr:`width` elements (the buffer is then its own packing)."""
        return self.width * self.parts == self.numel

    def piece(self, i: int) -> tuple[int, int]:
        """Piece ``i``'s ``(start, end)`` element offsets."""
        return self.bounds[i], self.bounds[i + 1]

    def pack(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[P·width]``: the pieces back to back, zero-padded (``buffer`` itself when the
        pieces are of equal length)."""
        if self.uniform:
            return buffer
        packed = buffer.new_zeros(self.parts, self.width)
        for i in range(self.parts):
            a, b = self.piece(i)
            packed[i, : b - a].copy_(buffer[a:b])
        return packed.view(-1)

    def unpack(self, packed: torch.Tensor, buffer: torch.Tensor) -> None:
        """Copy the pieces of ``packed`` (``[P·width]``, from :meth:`pack`'s layout) into ``buffer``."""
        if packed.data_ptr() == buffer.data_ptr():
            return
        rows = packed.view(self.parts, self.width)
        for i in range(self.parts):
            a, b = self.piece(i)
            buffer[a:b].copy_(rows[i, : b - a])

    def piece_matrices(self, i: int, piece: torch.Tensor) -> list[torch.Tensor]:
        """The row blocks of every matrix that piece ``i`` holds, as 2-D views of ``piece``
        (its elements, ``[bounds[i+1] − bounds[i]]``); the piece as one row for even splits."""
        a, b = self.piece(i)
        if self.runs is None:
            return [piece.view(1, -1)] if b > a else []
        blocks = []
        for start, rows, cols in self.runs:
            lo, hi = max(start, a), min(start + rows * cols, b)
            if lo < hi:
                blocks.append(piece[lo - a : hi - a].view((hi - lo) // cols, cols))
        return blocks


def even_plan(numel: int, parts: int) -> ShardPlan:
    """Pieces of ``ceil(numel/parts)`` elements (the last ones shorter, possibly empty)."""
    width = -(-numel // parts)
    return ShardPlan(tuple(min(i * width, numel) for i in range(parts + 1)))


def row_aligned_plan(buffer: torch.Tensor, matrices: Sequence[torch.Tensor], parts: int) -> ShardPlan:
    """Pieces as near ``numel/parts`` as the rows allow: each cut lies on the row boundary of
    ``matrices`` nearest to ``i·numel/parts`` (or anywhere outside them), so every piece holds
    whole rows, which per-matrix compressors (PowerSGD) need.

    Args:
        buffer: flat 1-D tensor of ``numel`` elements.
        matrices: views of ``buffer`` whose last dimension is contiguous (a row); the leading
            dimensions flatten to the rows (``GradBucket.matrices``).
    Raises:
        ValueError: a matrix that is not a view of ``buffer`` or whose rows are not contiguous.
    """
    runs = tuple(run for m in matrices for run in _row_runs(buffer, m))
    numel, cuts = buffer.numel(), [0]
    for i in range(1, parts):
        target = round(i * numel / parts)
        cut = next((s + round((target - s) / c) * c for s, r, c in runs if s < target < s + r * c), target)
        cuts.append(max(cut, cuts[-1]))
    return ShardPlan((*cuts, numel), runs)


def _row_runs(buffer: torch.Tensor, m: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(start, rows, cols)`` of each run of ``m``'s rows that lie back to back in ``buffer``."""
    if m.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr() or (m.dim() and m.stride(-1) != 1):
        raise ValueError(
            f"a matrix of shape {tuple(m.shape)} is not a row-contiguous view of its bucket's buffer; "
            "GradBucket.matrices must be views of GradBucket.buffer"
        )
    cols = m.shape[-1] if m.dim() else 1
    starts = torch.tensor(m.storage_offset() - buffer.storage_offset(), dtype=torch.int64)
    for size, stride in zip(m.shape[:-1], m.stride()[:-1], strict=True):
        starts = starts.unsqueeze(-1) + torch.arange(size) * stride
    starts = starts.reshape(-1)
    if starts.numel() == 0 or cols == 0:
        return []
    breaks = (torch.nonzero(starts[1:] != starts[:-1] + cols).view(-1) + 1).tolist()
    edges = [0, *breaks, starts.numel()]
    return [(int(starts[a]), b - a, cols) for a, b in zip(edges, edges[1:], strict=False)]


def intra_reduce_scatter(buffer: torch.Tensor, plan: ShardPlan, intra: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``buffer`` (1-D) over the host and return this rank's piece of the sum, padded:
    ``[plan.width]``, of which the first ``len(piece)`` elements are meaningful."""
    shard = buffer.new_empty(plan.width)
    dist.reduce_scatter_single(shard, plan.pack(buffer), group=intra)
    return shard


def intra_all_gather(shard: torch.Tensor, plan: ShardPlan, intra: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    """Write every rank's ``shard`` (``[plan.width]``) of the host into its piece of ``buffer``."""
    packed = buffer if plan.uniform else shard.new_empty(plan.parts * plan.width)
    dist.all_gather_single(packed, shard, group=intra)
    plan.unpack(packed, buffer)


# ---------------------------------------------------------------------------- collectives


def hierarchical_all_reduce(t: torch.Tensor, groups: HostGroups) -> torch.Tensor:
    """Sum ``t`` (contiguous, any shape, ``N`` elements) in place over all ranks of ``groups``:
    reduce-scatter in the host (``ceil(N/P)``-element pieces, the last zero-padded), all-reduce
    of the piece across hosts, all-gather in the host. Returns ``t``.

    Per rank this sends ``2·(P−1)/P·N`` elements inside the host and ``2·(H−1)/H·N/P`` across
    hosts, against the flat ring's ``2·(n−1)/n·N`` on a ring that crosses hosts.
    """
    flat = t.view(-1)
    plan = even_plan(flat.numel(), groups.procs_per_host)
    shard = intra_reduce_scatter(flat, plan, groups.intra)
    dist.all_reduce(shard, group=groups.inter)
    intra_all_gather(shard, plan, groups.intra, flat)
    return t


def hierarchical_reduce_scatter(out: torch.Tensor, t: torch.Tensor, groups: HostGroups) -> torch.Tensor:
    """Sum reduce-scatter, as ``dist.reduce_scatter_single(out, t)`` on the flat group: ``t``
    is 1-D ``[n·k]``, chunk ``i`` for the rank at flat position ``i``; ``out`` ``[k]`` gets the
    sum of this rank's chunk. Chunks are reordered local-index-major, reduce-scattered in the
    host (each rank gets the ``H`` chunks of its inter group), then across hosts. Returns ``out``.
    """
    n = groups.num_hosts * groups.procs_per_host
    block = t.new_empty(groups.num_hosts * out.numel())
    dist.reduce_scatter_single(block, t.view(n, -1)[groups.chunk_order].view(-1), group=groups.intra)
    dist.reduce_scatter_single(out, block, group=groups.inter)
    return out


def hierarchical_all_gather(out: torch.Tensor, t: torch.Tensor, groups: HostGroups) -> torch.Tensor:
    """All-gather, as ``dist.all_gather_single(out, t)`` on the flat group: ``t`` ``[k]``,
    ``out`` ``[n·k]`` with chunk ``i`` from the rank at flat position ``i``. Gathers across
    hosts, then in the host, then puts chunks in flat order. Returns ``out``."""
    n = groups.num_hosts * groups.procs_per_host
    block = t.new_empty(groups.num_hosts * t.numel())
    dist.all_gather_single(block, t, group=groups.inter)
    gathered = t.new_empty(n * t.numel())
    dist.all_gather_single(gathered, block, group=groups.intra)
    out.view(n, -1).index_copy_(0, groups.chunk_order, gathered.view(n, -1))
    return out


def hierarchical_all_to_all(out: torch.Tensor, t: torch.Tensor, groups: HostGroups) -> torch.Tensor:
    """All-to-all with equal chunks, as ``dist.all_to_all_single(out, t)`` on the flat group:
    ``t`` ``[n·k]``, chunk ``i`` for flat position ``i``; ``out`` ``[n·k]``, chunk ``i`` from
    flat position ``i``. Step 1, in the host: each rank sends local index ``l`` the chunks for
    inter group ``l``. Step 2, across hosts: each rank sends each host's peer the ``P`` chunks
    its host holds for that peer. Then chunks are put in flat order. Returns ``out``."""
    hosts, procs = groups.num_hosts, groups.procs_per_host
    n, k = hosts * procs, t.numel() // (hosts * procs)
    gathered = torch.empty_like(t)
    dist.all_to_all_single(gathered, t.view(n, k)[groups.chunk_order].view(-1), group=groups.intra)
    by_peer = gathered.view(procs, hosts, k).transpose(0, 1).contiguous()
    received = torch.empty_like(t)
    dist.all_to_all_single(received, by_peer.view(-1), group=groups.inter)
    out.view(n, k).index_copy_(0, groups.all_to_all_sources, received.view(n, k))
    return out


# ---------------------------------------------------------------------------- cost model


# Transfer/latency ratio of the flat collective above which auto considers hierarchical.
BANDWIDTH_BOUND = 8


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta (Hockney) times of flat and hierarchical collectives on ``H × P`` ranks.

    A step costs the link's latency ``a`` plus bytes over its bandwidth ``b`` (Hockney, "The
    communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 1994);
    the algorithms are the ring (all-reduce: ``2(m−1)`` steps moving ``2(m−1)/m·S``;
    reduce-scatter and all-gather: ``m−1`` steps, ``(m−1)/m·S``) and the pairwise all-to-all
    (``m−1`` steps, ``(m−1)/m·S``), per Thakur, Rabenseifner & Gropp, "Optimization of
    Collective Communication Operations in MPICH" (2005). For ``S`` bytes, ``n = H·P``:

    - flat ring over hosts: every step waits for the inter-host link, which carries one ring
      edge: all-reduce ``2(n−1)·a_e + 2(n−1)/n·S/b_e``; all-to-all sends ``P·(H−1)/H·S`` over
      each host's link (its ``P`` ranks' traffic to other hosts).
    - hierarchical: the intra phases (reduce-scatter + all-gather for all-reduce: ``2(P−1)·a_i
      + 2(P−1)/P·S/b_i``; one phase for the others) plus the inter phase, ``P`` rings of
      ``S/P`` sharing each host's link: all-reduce ``2(H−1)·a_e + 2(H−1)/H·S/b_e``.

    Attributes:
        num_hosts, procs_per_host: ``H`` and ``P``.
        intra_latency, intra_bandwidth: ``a_i`` (s), ``b_i`` (bytes/s); ``nan`` when ``P = 1``.
        inter_latency, inter_bandwidth: ``a_e``, ``b_e``, the slowest inter-host link; ``nan``
            when ``H = 1``.
    """

    num_hosts: int
    procs_per_host: int
    intra_latency: float
    intra_bandwidth: float
    inter_latency: float
    inter_bandwidth: float

    @classmethod
    def from_topology(
        cls, topology: Topology, num_hosts: int | None = None, procs_per_host: int | None = None
    ) -> CostModel:
        """The model of ``num_hosts × procs_per_host`` ranks (default: all of ``topology``)
        with ``topology``'s measured figures.

        Raises:
            ValueError: hosts of different sizes, or a figure the layout needs was not measured
                (``link_bandwidth``/``link_latency`` are ``None``: discover the topology with
                ``probe=True``).
        """
        hosts = topology.num_hosts if num_hosts is None else num_hosts
        procs = topology.procs_per_host if procs_per_host is None else procs_per_host
        if procs is None:
            raise ValueError(f"hosts {topology.hosts} hold different numbers of ranks; the cost model needs equal ones")
        intra = (topology.intra_host_latency(), topology.intra_host_bandwidth()) if procs > 1 else (math.nan,) * 2
        inter = (topology.inter_host_latency(), topology.inter_host_bandwidth()) if hosts > 1 else (math.nan,) * 2
        if None in intra or None in inter:
            raise ValueError(
                "the topology has no measured link_latency/link_bandwidth for this layout; "
                "discover it with discover_topology(probe=True) or give the figures"
            )
        return cls(hosts, procs, *intra, *inter)

    def flat_terms(self, op: str, nbytes: int) -> tuple[float, float]:
        """``(latency, transfer)`` seconds of the flat collective ``op`` on ``nbytes``."""
        n, hosts = self.num_hosts * self.procs_per_host, self.num_hosts
        if hosts == 1:
            return _ring(op, n, nbytes, self.intra_latency, self.intra_bandwidth)
        latency, transfer = _ring(op, n, nbytes, self.inter_latency, self.inter_bandwidth)
        if op == "all_to_all":
            transfer = self.procs_per_host * (hosts - 1) / hosts * nbytes / self.inter_bandwidth
        return latency, transfer

    def hierarchical_terms(self, op: str, nbytes: int) -> tuple[float, float]:
        """``(latency, transfer)`` seconds of the hierarchical ``op`` (the flat figures when
        one level is trivial: one host, or one rank per host)."""
        hosts, procs = self.num_hosts, self.procs_per_host
        if hosts == 1 or procs == 1:
            return self.flat_terms(op, nbytes)
        intra = _ring("reduce_scatter", procs, nbytes, self.intra_latency, self.intra_bandwidth)
        phases = 2 if op == "all_reduce" else 1
        latency, transfer = _ring(op, hosts, nbytes, self.inter_latency, self.inter_bandwidth)
        if op == "all_to_all":
            transfer *= procs
        return latency + phases * intra[0], transfer + phases * intra[1]

    def predict_seconds(self, op: str, nbytes: int) -> dict[str, float]:
        """Predicted seconds of ``op`` on ``nbytes`` bytes: ``{"flat": ..., "hierarchical": ...}``."""
        return {FLAT: sum(self.flat_terms(op, nbytes)), HIERARCHICAL: sum(self.hierarchical_terms(op, nbytes))}

    def choice(self, op: str, nbytes: int, margin: float = 0.1) -> str:
        """``"hierarchical"`` only where the model predicts a clear win from its transfer
        terms, which the measured bandwidths pin down well:

        - the flat collective is well into the bandwidth-bound regime: transfer time at least
          ``BANDWIDTH_BOUND`` (8) times its latency, i.e. each ring step moves 8 times the link's
          half-performance length ``n½ = a_e·b_e`` (Hockney 1994). Below that the two extra
          collective calls of the hierarchical path (each about a latency, plus scheduling on
          a busy host) eat the predicted saving: on 2 emulated hosts × 2 ranks at 100 Mbit/s,
          64 KiB all-reduce was predicted 33 % faster hierarchical and measured 7 % slower;
        - the hierarchical transfer time is at most the flat one (a win that rests on fewer
          latency steps alone, as the all-to-all's, is not taken);
        - the hierarchical total is at most ``(1 − margin)`` of the flat one.

        Latency differences are of the order of the costs the model leaves out (two more
        collective calls, packing copies, skew between hosts); hierarchical all-reduce slower
        than flat on a real cluster is Horovod issue 328. Else ``"flat"``."""
        if self.num_hosts == 1 or self.procs_per_host == 1:
            return FLAT
        latency, transfer = self.flat_terms(op, nbytes)
        hier_latency, hier_transfer = self.hierarchical_terms(op, nbytes)
        clear = hier_latency + hier_transfer <= (1 - margin) * (latency + transfer)
        bound = transfer >= BANDWIDTH_BOUND * latency
        return HIERARCHICAL if bound and hier_transfer <= transfer and clear else FLAT


def _ring(op: str, m: int, nbytes: int, latency: float, bandwidth: float) -> tuple[float, float]:
    """``(latency, transfer)`` seconds of the ring (or pairwise all-to-all) ``op`` on ``m`` ranks."""
    if op not in OPS:
        raise ValueError(f"op {op!r} is not one of {OPS}")
    steps = 2 * (m - 1) if op == "all_reduce" else m - 1
    return steps * latency, steps / m * nbytes / bandwidth


# ---------------------------------------------------------------------------- hooks


class HierarchicalHook(CommHook):
    """Gradient all-reduce in two levels; ``inner`` reduces only what crosses hosts.

    ``reduce``: the bucket is cut into ``P`` pieces (even, for the dense :class:`AllReduceHook`;
    at row boundaries of ``bucket.matrices`` for any other hook, which may compress per matrix)
    and reduce-scattered in the host (blocking, fast); this rank's piece, divided by ``P``, is
    handed to ``inner`` as a :class:`GradBucket` of the same ``index`` whose ``matrices`` are
    the row blocks it holds, reduced over the inter group (asynchronously: the slow inter-host
    part overlaps the rest of backward); the handle's ``wait()`` finishes it and all-gathers the
    pieces in the host. The result is the average over all ranks of the group. Groups within
    one host, with one rank per host, or with hosts of different sizes (one warning) are
    reduced flat by ``inner``.

    ``reduce_scatter`` (ZeRO stages 2-3) and ``average_replicas`` (HSDP) are ``inner``'s, flat
    on the given group: for ZeRO across hosts, shard inside a host and replicate across hosts
    (``dp_replicate`` = hosts, HSDP), so that only the replica average crosses hosts.

    Bytes: ``bytes_sent`` counts all this rank sent (intra reduce-scatter and all-gather plus
    ``inner``'s); the part that crossed hosts is also counted under ``INTER_HOST_AXIS``:
    ``inner``'s bytes on the inter group; on a flat path, under the ring model (a rank sends
    only to its successor in the group), all of them when the successor is on another host.
    ``dense_bytes`` is the flat dense all-reduce's (or reduce-scatter's) volume. ``method``,
    ``state_dict``, ``load_state_dict`` and ``on_step_end`` are ``inner``'s, so a compressor's
    residuals (keyed by bucket index, shaped like its piece) are checkpointed as usual.

    :meth:`setup` must run (on every rank) before the first reduction.

    Args:
        topology: the job's hosts (identical on every rank).
        inner: the hook for the inter-host reduction (default :class:`AllReduceHook`).
    """

    counts_inter_host = True

    def __init__(self, topology: Topology, inner: CommHook | None = None):
        super().__init__()
        self.topology = topology
        self.inner = inner if inner is not None else AllReduceHook()
        self._layouts: dict[tuple[int, ...], HostGroups | None] = {}
        self._plans: dict[int, ShardPlan] = {}

    @property
    def method(self) -> str:
        """``inner``'s compression method (a checkpoint's residuals load into the same kind)."""
        return self.inner.method

    def setup(self, groups: list[list[int]]) -> None:
        """Split each gradient group by host and create its intra and inter groups (on every
        rank, for every group, in the order given); remember this rank's. See
        :meth:`CommHook.setup`."""
        for ranks in groups:
            key = tuple(sorted(ranks))
            hosts = split_by_host(self.topology, key)
            flat = len(hosts) == 1 or all(len(h) == 1 for h in hosts)
            if not flat and len({len(h) for h in hosts}) > 1:
                if dist.get_rank() in key:
                    log.warning("gradient group %s spans hosts of unequal sizes %s: reduced flat", list(key), hosts)
                flat = True
            made = None if flat else new_host_groups(hosts)
            if dist.get_rank() in key:
                self._layouts[key] = made

    def _layout(self, group: dist.ProcessGroup) -> HostGroups | None:
        key = tuple(sorted(dist.get_process_group_ranks(group)))
        if key not in self._layouts:
            raise RuntimeError(
                f"{type(self).__name__}.setup() was not called with the gradient group {list(key)}; call "
                "hook.setup(groups) on every rank, with every gradient group, before the first reduction"
            )
        return self._layouts[key]

    def _path(self, bucket: GradBucket, layout: HostGroups) -> str:
        """The path of ``bucket`` on a group with a two-level ``layout``."""
        del bucket, layout
        return HIERARCHICAL

    def reduce(self, bucket: GradBucket, group: dist.ProcessGroup) -> Pending:
        """Start the averaged reduction of ``bucket.buffer`` (1-D) over ``group``; the
        handle's ``wait()`` returns ``bucket.buffer`` holding the average."""
        self.dense_bytes += all_reduce_bytes(bucket.nbytes, dist.get_world_size(group))
        layout = self._layout(group)
        if layout is None or self._path(bucket, layout) == FLAT:
            return self._flat(lambda: self.inner.reduce(bucket, group), group)
        return self._hierarchical(bucket, layout)

    def _plan(self, bucket: GradBucket, parts: int) -> ShardPlan:
        plan = self._plans.get(bucket.index)
        if plan is None or plan.numel != bucket.buffer.numel() or plan.parts != parts:
            if isinstance(self.inner, AllReduceHook) or not bucket.matrices:
                plan = even_plan(bucket.buffer.numel(), parts)
            else:
                plan = row_aligned_plan(bucket.buffer, bucket.matrices, parts)
            self._plans[bucket.index] = plan
        return plan

    def _hierarchical(self, bucket: GradBucket, layout: HostGroups) -> Pending:
        procs, local = layout.procs_per_host, layout.local_index
        plan = self._plan(bucket, procs)
        wire_bytes = plan.parts * plan.width * bucket.buffer.element_size()
        padded = intra_reduce_scatter(bucket.buffer, plan, layout.intra)
        self.bytes_sent += reduce_scatter_bytes(wire_bytes, procs)
        start, end = plan.piece(local)
        padded[: end - start].div_(procs)
        return self._across_then_gather(bucket, plan, local, padded, layout.inter, layout.intra)

    def _across_then_gather(self, bucket: GradBucket, plan: ShardPlan, local: int, padded: torch.Tensor,
                            inter: dist.ProcessGroup, intra: dist.ProcessGroup) -> Pending:  # fmt: skip
        """The two-level reduction's second half: piece ``local`` of ``plan`` (the first elements
        of ``padded``, ``[plan.width]``) averaged over ``inter`` by ``inner`` (started now; the
        same piece layout on every rank of ``inter``), then, in ``wait()``, every piece
        all-gathered over ``intra`` into ``bucket.buffer``, which it returns."""
        start, end = plan.piece(local)
        shard = padded[: end - start]
        handle = None
        if end > start:
            piece = GradBucket(bucket.index, shard, [], [], [], matrices=plan.piece_matrices(local, shard))
            handle = self._counted(lambda: self.inner.reduce(piece, inter), crosses_hosts=True)

        def finish() -> torch.Tensor:
            if handle is not None:
                reduced = self._counted(lambda: reduced_value(handle.wait()), crosses_hosts=True)
                if reduced.data_ptr() != shard.data_ptr():
                    shard.copy_(reduced)
            intra_all_gather(padded, plan, intra, bucket.buffer)
            self.bytes_sent += all_gather_bytes(plan.parts * plan.width * bucket.buffer.element_size(), plan.parts)
            return bucket.buffer

        return Pending(None, finish)

    def _flat(self, start: Callable[[], Any], group: dist.ProcessGroup) -> Pending:
        """Run ``inner``'s reduction ``start`` on the whole group, counting its bytes."""
        crosses = self._sends_across_hosts(group)
        handle = self._counted(start, crosses)
        return Pending(None, lambda: self._counted(lambda: reduced_value(handle.wait()), crosses))

    def _counted(self, call: Callable[[], Any], crosses_hosts: bool) -> Any:
        """``call()``, adding the bytes ``inner`` counted during it to this hook's."""
        before = self.inner.bytes_sent
        result = call()
        sent = self.inner.bytes_sent - before
        self.bytes_sent += sent
        if crosses_hosts:
            self.traffic.bytes[INTER_HOST_AXIS] += sent
        return result

    def _sends_across_hosts(self, group: dist.ProcessGroup) -> bool:
        """Whether this rank's successor in ``group``'s ring is on another host."""
        ranks, me = dist.get_process_group_ranks(group), dist.get_rank()
        successor = ranks[(ranks.index(me) + 1) % len(ranks)]
        return self.topology.host_of(successor) != self.topology.host_of(me)

    def reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup, bucket: GradBucket | None = None
    ) -> Pending:
        """``inner``'s reduce-scatter on ``group``, flat (see the class docstring)."""
        self.dense_bytes += reduce_scatter_bytes(flat.numel() * flat.element_size(), dist.get_world_size(group))
        return self._flat(lambda: self.inner.reduce_scatter(flat, out, group, bucket), group)

    def average_replicas(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """``inner``'s replica average on ``group``, flat."""
        self.dense_bytes += all_reduce_bytes(tensor.numel() * tensor.element_size(), dist.get_world_size(group))
        self._counted(lambda: self.inner.average_replicas(tensor, group), self._sends_across_hosts(group))

    def count_into(self, traffic: Traffic) -> None:
        """As :meth:`CommHook.count_into`, carrying the inter-host count over too."""
        traffic.bytes[INTER_HOST_AXIS] += self.traffic.bytes[INTER_HOST_AXIS]
        super().count_into(traffic)

    def on_step_end(self) -> None:
        """Count the step here and in ``inner`` (its warm-up counts steps)."""
        super().on_step_end()
        self.inner.on_step_end()

    def state_dict(self) -> dict:
        """``inner``'s state (residuals keyed by bucket index, shaped like this rank's piece)."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore ``inner``'s state from :meth:`state_dict`."""
        self.inner.load_state_dict(state)


class ReplicaSplitHook(HierarchicalHook):
    """The two-level reduction of groups whose ranks already hold equal buffers: a local mode's
    replicas of ``P`` plain-DP ranks each (``replica``: this rank's), whose ranks end their inner
    steps on the same parameters. ``reduce(bucket, group)`` (``group``: the same rank of every
    replica) skips :class:`HierarchicalHook`'s reduce-scatter inside the replica, since the
    pieces are already equal: rank ``j`` of a replica hands piece ``j`` of ``bucket.buffer``
    (cut as :class:`HierarchicalHook` cuts it for ``inner``) to ``inner``, which averages it over
    ``group``, and the replica all-gathers the averaged pieces. Each rank sends ``1/P`` of the
    buffer across replicas instead of all of it: where a replica is a host, the bytes between
    hosts fall ``P``-fold (the inter-host step of the hierarchical all-reduce, Jia et al., "Highly
    Scalable Deep Learning Training System with Mixed-Precision", 2018, §3; Horovod's).

    Bytes: ``inner``'s, also counted under ``INTER_HOST_AXIS`` (replicas are taken to be on
    different hosts), and the all-gather inside the replica. Nothing to :meth:`setup`.

    Args:
        replica: this rank's replica (``P`` ranks holding equal buffers).
        inner: the hook averaging a piece across replicas (default :class:`AllReduceHook`).
    """

    def __init__(self, replica: dist.ProcessGroup, inner: CommHook | None = None):
        # Not HierarchicalHook.__init__: no topology to split by host, the groups are given.
        CommHook.__init__(self)
        self.inner = inner if inner is not None else AllReduceHook()
        self.replica = replica
        self._plans: dict[int, ShardPlan] = {}

    def setup(self, groups: list[list[int]]) -> None:
        """Nothing: the groups are given."""
        del groups

    def reduce(self, bucket: GradBucket, group: dist.ProcessGroup) -> Pending:
        """Start the average of ``bucket.buffer`` (1-D, equal on the replica's ranks) over the
        replicas; the handle's ``wait()`` returns ``bucket.buffer`` holding it."""
        self.dense_bytes += all_reduce_bytes(bucket.nbytes, dist.get_world_size(group))
        parts, local = dist.get_world_size(self.replica), dist.get_rank(self.replica)
        plan = self._plan(bucket, parts)
        start, end = plan.piece(local)
        padded = bucket.buffer.new_zeros(plan.width)
        padded[: end - start] = bucket.buffer[start:end]
        return self._across_then_gather(bucket, plan, local, padded, group, self.replica)


# All-reduce sizes (bytes) that ``auto`` times both ways at set-up: where latency, scheduling
# and the extra calls of the hierarchical path matter, which the cost model does not capture.
CALIBRATION_BYTES = (64 * 2**10, 256 * 2**10, 2**20)
CALIBRATION_REPEATS = 3


def measure_winners(groups: HostGroups, group: dist.ProcessGroup, sizes: Sequence[int] = CALIBRATION_BYTES,
                    repeats: int = CALIBRATION_REPEATS, margin: float = 0.05) -> dict[int, str]:  # fmt: skip
    """Per all-reduce size (bytes): ``"hierarchical"`` where it measured at least ``margin``
    faster than flat over ``group`` (the ranks of ``groups``), else ``"flat"``. A collective
    over ``group``; times are the slowest rank's (all-reduced), medians over ``repeats`` after
    one warm-up each, flat and hierarchical interleaved, so every rank gets the same answer.
    Costs about ``(repeats + 1) · 2`` all-reduces of each size (1.3 s on 2 emulated hosts ×
    2 ranks at 100 Mbit/s)."""
    winners = {}
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4, device=_backend_device())
        runs = {FLAT: lambda t=t: dist.all_reduce(t, group=group),
                HIERARCHICAL: lambda t=t: hierarchical_all_reduce(t, groups)}  # fmt: skip
        times = {mode: [] for mode in runs}
        for i in range(repeats + 1):
            for mode, run in runs.items():
                elapsed = _time_collective(run, group)
                if i:
                    times[mode].append(elapsed)
        flat, hier = (statistics.median(times[m]) for m in (FLAT, HIERARCHICAL))
        winners[nbytes] = HIERARCHICAL if hier <= (1 - margin) * flat else FLAT
    return winners


def _backend_device() -> torch.device:
    """Where the default group's collectives take tensors: this rank's GPU under NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _time_collective(run: Callable[[], Any], group: dist.ProcessGroup) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    run()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def calibrated_choice(nbytes: int, winners: dict[int, str], model: CostModel | None, margin: float) -> str:
    """Flat or hierarchical all-reduce of ``nbytes``: hierarchical only where the measurement
    (``winners``, :func:`measure_winners`) says so for every calibrated size from ``nbytes`` up
    and, above the largest calibrated size, the cost model (``model``, accurate once transfers
    dominate) agrees. Flat without a model or measurement."""
    if model is None or not winners:
        return FLAT
    measured = [w for size, w in sorted(winners.items()) if size >= nbytes]
    if measured:
        return HIERARCHICAL if all(w == HIERARCHICAL for w in measured) else FLAT
    largest = winners[max(winners)]
    return (
        HIERARCHICAL if largest == HIERARCHICAL and model.choice("all_reduce", nbytes, margin) == HIERARCHICAL else FLAT
    )


class AutoHook(HierarchicalHook):
    """Per bucket, ``inner`` flat on the whole group or hierarchically (:class:`HierarchicalHook`),
    whichever :func:`calibrated_choice` picks for the bucket's size: measured at set-up for
    sizes up to 1 MiB, the cost model (:meth:`CostModel.choice`) confirmed by the largest
    measured size above.

    The choice depends only on the topology and the all-reduced timings (identical on every
    rank) and the bucket's size, so every rank takes the same path, and it is fixed per bucket
    index at its first reduction (a compressor's residual keeps its shape). A topology without
    measured links, one host, or one rank per host: flat. The model counts dense bytes; a
    compressing ``inner`` changes both paths' inter-host volume (gather-based compressors save
    more hierarchically, PowerSGD moves the dense bucket inside hosts), which the model does
    not see.

    Args:
        topology: the job's hosts and measured links.
        inner: the hook of both paths (default :class:`AllReduceHook`).
        margin: hierarchical must be predicted at least this fraction faster than flat.
    """

    def __init__(self, topology: Topology, inner: CommHook | None = None, margin: float = 0.1):
        super().__init__(topology, inner)
        self.margin = margin
        self.paths: dict[int, str] = {}
        self._models: dict[tuple[int, int], CostModel | None] = {}

    def _model(self, hosts: int | None = None, procs: int | None = None) -> CostModel | None:
        key = (hosts, procs)
        if key not in self._models:
            try:
                self._models[key] = CostModel.from_topology(self.topology, hosts, procs)
            except ValueError as err:
                log.warning("comm_hook 'auto' reduces flat: %s", err)
                self._models[key] = None
        return self._models[key]

    def predict_seconds(self, nbytes: int, op: str = "all_reduce") -> dict[str, float]:
        """:meth:`CostModel.predict_seconds` on the whole topology's layout.

        Raises:
            ValueError: see :meth:`CostModel.from_topology`.
        """
        return CostModel.from_topology(self.topology).predict_seconds(op, nbytes)

    def choice(self, nbytes: int, op: str = "all_reduce") -> str:
        """``"flat"`` or ``"hierarchical"`` for ``op`` on ``nbytes`` over the whole topology."""
        model = self._model()
        return FLAT if model is None else model.choice(op, nbytes, self.margin)

    def setup(self, groups: list[list[int]]) -> None:
        """:meth:`HierarchicalHook.setup`, then time flat against hierarchical all-reduce on this
        rank's gradient group (:func:`measure_winners`), where it spans hosts."""
        super().setup(groups)
        self.winners: dict[tuple[int, ...], dict[int, str]] = {}
        # new_group is collective over the world: every rank makes every group, keeps its own.
        mine = {}
        for ranks in groups:
            group = dist.new_group(sorted(ranks))
            if dist.get_rank() in ranks:
                mine[tuple(sorted(ranks))] = group
        for key, group in mine.items():
            layout = self._layouts.get(key)
            if layout is not None and self._model(layout.num_hosts, layout.procs_per_host) is not None:
                self.winners[key] = measure_winners(layout, group)
                log.info("comm_hook 'auto': measured winners per all-reduce size %s", self.winners[key])

    def _path(self, bucket: GradBucket, layout: HostGroups) -> str:
        path = self.paths.get(bucket.index)
        if path is None:
            model = self._model(layout.num_hosts, layout.procs_per_host)
            winners = self.winners.get(tuple(sorted(r for h in layout.hosts for r in h)), {})
            path = calibrated_choice(bucket.nbytes, winners, model, self.margin)
            self.paths[bucket.index] = path
            log.info("comm_hook 'auto': bucket %d (%d bytes) reduced %s", bucket.index, bucket.nbytes, path)
        return path


def host_hook(comm_hook: str, topology: Topology | None, inner: CommHook) -> CommHook:
    """``inner`` as ``data_parallel.comm_hook`` asks: itself (``"allreduce"``: flat), inside a
    :class:`HierarchicalHook` (``"hierarchical"``) or an :class:`AutoHook` (``"auto"``), which
    read ``topology`` (the job's). The hook is not set up (:meth:`CommHook.setup`).

    Raises:
        ValueError: ``"hierarchical"`` or ``"auto"`` without a topology.
    """
    if comm_hook == "allreduce":
        return inner
    if topology is None:
        raise ValueError(f"data_parallel.comm_hook={comm_hook!r} needs the job's topology (discover_topology())")
    return {HIERARCHICAL: HierarchicalHook, "auto": AutoHook}[comm_hook](topology, inner)


def reduced_value(reduced: Any) -> Any:
    """A future's value (a one-element list of the tensor) or a handle's result, unwrapped."""
    return reduced[0] if isinstance(reduced, list) else reduced
