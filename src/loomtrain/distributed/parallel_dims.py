"""The one owner of the process layout: degrees, the DeviceMesh, its process groups, and the
launcher's rank variables.

Every other module asks this object (or :func:`launch_env`, :func:`is_main_process` and
:func:`shard_range`) for ranks, groups and chunk sizes instead of doing rank arithmetic.
Mesh axes (:class:`Axis`), outermost first; the innermost axes talk most, so they get
adjacent ranks (on one node, the fastest links):

- ``pp``: pipeline parallel. Each pipeline rank holds some of the layers (its stages) and
  sends activations to the next rank, gradients to the previous one: the least traffic, so
  outermost (across nodes when there are several).
- ``dp_replicate``: data-parallel replica groups (HSDP; Zhao et al., "PyTorch FSDP", VLDB
  2023, §3.2.2 "hybrid sharding"). Each group holds a whole copy of the model state; only
  the gradient average crosses groups, so this axis can span hosts while sharding stays inside one.
- ``dp_shard``: data-parallel ranks within a replica group. Replicas (ZeRO stage 0) or
  shards (stages 1–3) of the model state. Each ``dp_replicate × dp_shard`` rank reads
  different micro-batches; ``dp`` is their product.
- ``sp``: Ulysses sequence parallel (Jacobs et al. 2023): each rank holds a slice of the
  sequence; attention switches to a head split by all-to-all.
- ``tp``: tensor parallel (Shoeybi et al. 2019, Megatron-LM): weight matrices split across
  ranks; Megatron sequence parallelism (Korthikanti et al. 2022) runs on this axis too.

The ``sp`` ranks of one ``dp`` index hold the same parameters and different tokens, so
gradients are averaged over ``dp_replicate × dp_shard × sp`` (the flattened ``dp_sp`` axis,
:attr:`ParallelDims.grad_mesh`), and ZeRO shards model state over ``dp_shard × sp`` (the
flattened ``dp_shard_sp`` axis, :attr:`ParallelDims.shard_mesh`), within one pipeline rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from loomtrain.config import ConfigError, ParallelConfig


class Axis(StrEnum):
    """Names of the mesh axes: the five of the mesh, outermost first, then the flattened ones."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    SP = "sp"
    TP = "tp"
    DP_SP = "dp_sp"  # dp_replicate × dp_shard × sp: the ranks whose gradients are averaged
    DP_SHARD_SP = "dp_shard_sp"  # dp_shard × sp: the ranks ZeRO shards over
    TP_ROW = "tp_row"  # 2D tensor parallelism: tp = tp_row × tp_col, the grid's row index (outer)
    TP_COL = "tp_col"  # and its column index (inner: a grid row is q consecutive tp ranks)


MESH_AXES = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.SP, Axis.TP)
# The axes whose group ranks must equal the mesh coordinates: every mesh axis (rank(), DTensor)
# and ZeRO's flattened shard axis (DTensor Shard(0)). dp_sp groups only reduce, in any order.
ORDERED_AXES = (*MESH_AXES, Axis.DP_SHARD_SP)
FLATTENED_AXES = {Axis.DP_SP: (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.SP), Axis.DP_SHARD_SP: (Axis.DP_SHARD, Axis.SP)}


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun, ``loomtrain train``, the spawn helper) told this process:
    its global ``rank``, its ``local_rank`` on this host, the ``world_size``, and how many
    times torchrun's elastic agent has restarted the workers (``restart_count``)."""

    rank: int
    local_rank: int
    world_size: int
    restart_count: int


def launch_env() -> LaunchEnv:
    """This process's ranks as the launcher's environment variables give them (one process,
    rank 0, first attempt, when they are absent)."""
    env = os.environ
    return LaunchEnv(int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                     int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))  # fmt: skip


def is_main_process() -> bool:
    """Whether this is global rank 0, the one process that writes shared files and decides
    for all (needs an initialised process group)."""
    return dist.get_rank() == 0


def shard_rows(size: int, n: int) -> int:
    """Rows per rank, ``ceil(size / n)``, when a dimension of ``size`` is split over ``n``
    ranks in the chunk layout (see :func:`shard_range`)."""
    return math.ceil(size / n)


def shard_range(size: int, n: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s part of a dimension of ``size`` split over ``n`` ranks
    in the chunk layout of ``torch.chunk`` and DTensor ``Shard`` (``ceil(size / n)`` per rank,
    trailing ranks fewer or none). Tensor parallelism and ZeRO both split this way."""
    per_rank = shard_rows(size, n)
    start = min(rank * per_rank, size)
    return start, min(start + per_rank, size)


def sharded_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]
) -> DTensor:
    """``local`` (this rank's part, storage shared, not copied) as a DTensor of the contiguous
    full tensor of ``shape`` laid out by ``placements`` on ``mesh``."""
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees for ``world_size`` processes: ``pp × dp × sp × tp == world_size`` with
    ``dp = dp_replicate × dp_shard``, and where each rank sits in the mesh.

    ``rank_order`` places the ranks: the mesh's rank array (:meth:`mesh_ranks`, shape
    ``[pp, dp_replicate, dp_shard, sp, tp]``) is ``rank_order`` laid out row-major, so
    consecutive entries become the innermost axes' groups. ``None`` is the identity order
    ``0..world_size-1``; ``topology.place_ranks`` gives a host-major order that keeps tp (then
    sp, then dp_shard) inside a host when the launcher numbered the ranks otherwise. Every
    group of :data:`ORDERED_AXES` must list its ranks ascending: ``new_group`` sorts a group's
    ranks, so a group rank (what ``rank()`` and the collectives use) equals the mesh coordinate
    (what DTensor uses) only then. ``tp_2d``: the ``tp`` ranks form a ``q × q`` grid (2D tensor
    parallelism; :attr:`grid_mesh`), whose two axes must ascend in place of ``tp``.

    Raises:
        ConfigError: a degree below 1, degrees that do not multiply to ``world_size``, a ``dp``
            not divisible by ``dp_replicate``, or a ``rank_order`` that is not a permutation of
            ``0..world_size-1`` or puts a group of :data:`ORDERED_AXES` out of ascending order.
    """

    dp: int
    world_size: int
    tp: int = 1
    sp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    device_type: str = "cpu"
    rank_order: tuple[int, ...] | None = None
    tp_2d: bool = False

    def __post_init__(self) -> None:
        for name, value in (("data_parallel_degree", self.dp), ("tensor_parallel_degree", self.tp),
                            ("sequence_parallel_degree", self.sp), ("pipeline_parallel_degree", self.pp),
                            ("data_parallel_replicate_degree", self.dp_replicate)):  # fmt: skip
            if value < 1:
                raise ConfigError(f"parallel.{name}={value} must be at least 1")
        product = self.pp * self.dp * self.sp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees pp={self.pp} × dp={self.dp} × sp={self.sp} × tp={self.tp} = {product} "
                f"do not multiply to the world size {self.world_size}; change parallel.* or the process count"
            )
        if self.dp % self.dp_replicate:
            raise ConfigError(
                f"parallel.data_parallel_replicate_degree={self.dp_replicate} does not divide the data-parallel "
                f"degree {self.dp}; choose a divisor of it (1 shards over all dp ranks)"
            )
        if self.tp_2d and math.isqrt(self.tp) ** 2 != self.tp:
            raise ConfigError(f"parallel.tp_mode='2d' needs a square parallel.tensor_parallel_degree, got {self.tp}")
        if self.rank_order is not None:
            self._check_rank_order()

    def _check_rank_order(self) -> None:
        order = tuple(int(r) for r in self.rank_order)
        object.__setattr__(self, "rank_order", order)  # a list would make the frozen object unhashable
        if sorted(order) != list(range(self.world_size)):
            raise ConfigError(
                f"rank_order={order} is not a permutation of the ranks 0..{self.world_size - 1} (each once); "
                "pass topology.place_ranks(topology, dims), or None for the launcher's order"
            )
        for axis in self._ordered_axes():
            for group in self.grid_groups(axis) if axis in (Axis.TP_ROW, Axis.TP_COL) else self.axis_groups(axis):
                if group != sorted(group):
                    raise ConfigError(
                        f"rank_order={order} puts the {axis} group {group} out of ascending order; torch numbers a "
                        "group's ranks ascending (new_group sorts them), so group ranks would disagree with the "
                        "mesh coordinates that DTensor uses; pass topology.place_ranks(topology, dims), which "
                        "keeps every group ascending, or None"
                    )

    def _ordered_axes(self) -> tuple[Axis, ...]:
        """The axes whose groups must ascend: :data:`ORDERED_AXES`; under 2D tensor parallelism
        the two grid axes in place of tp (whose group only all-reduces gradient norms, and
        whose order host-major placement may permute to keep grid rows inside hosts)."""
        if not self.tp_2d:
            return ORDERED_AXES
        return (*(a for a in ORDERED_AXES if a != Axis.TP), Axis.TP_ROW, Axis.TP_COL)

    @classmethod
    def from_config(
        cls, cfg: ParallelConfig, world_size: int, device_type: str = "cpu", rank_order: Sequence[int] | None = None
    ) -> ParallelDims:
        """Degrees from ``[parallel]``; ``data_parallel_degree=-1`` takes what pp, tp and sp leave;
        ``rank_order`` as in the class (``topology.place_ranks(topology, dims)`` of the dims built
        without one).

        Raises:
            ConfigError: the world size is not divisible by ``pp × tp × sp``, degrees mismatch, or
                ``rank_order`` is refused (see the class).
        """
        tp, sp, pp = cfg.tensor_parallel_degree, cfg.sequence_parallel_degree, cfg.pipeline_parallel_degree
        dp = cfg.data_parallel_degree
        if dp == -1:
            if world_size % (pp * tp * sp):
                raise ConfigError(
                    f"world size {world_size} is not divisible by parallel.pipeline_parallel_degree={pp} × "
                    f"parallel.tensor_parallel_degree={tp} × parallel.sequence_parallel_degree={sp}; change the "
                    "degrees or the process count"
                )
            dp = world_size // (pp * tp * sp)
        return cls(dp=dp, world_size=world_size, tp=tp, sp=sp, pp=pp, dp_replicate=cfg.data_parallel_replicate_degree,
                   device_type=device_type, rank_order=None if rank_order is None else tuple(rank_order),
                   tp_2d=cfg.tp_mode == "2d")  # fmt: skip

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks within one replica group: what ZeRO shards over (with ``sp``)."""
        return self.dp // self.dp_replicate

    def degree(self, axis: Axis) -> int:
        """The number of ranks along ``axis`` (a mesh axis, a flattened one or a grid axis)."""
        sizes = {Axis.PP: self.pp, Axis.DP_REPLICATE: self.dp_replicate, Axis.DP_SHARD: self.dp_shard,
                 Axis.SP: self.sp, Axis.TP: self.tp, Axis.DP_SP: self.dp * self.sp,
                 Axis.DP_SHARD_SP: self.dp_shard * self.sp, Axis.TP_ROW: self.grid_side,
                 Axis.TP_COL: self.grid_side}  # fmt: skip
        return sizes[axis]

    def layout(self) -> dict[str, int]:
        """The degrees, as recorded in each checkpoint's manifest."""
        return {"pp": self.pp, "dp": self.dp, "dp_replicate": self.dp_replicate, "sp": self.sp, "tp": self.tp}

    def describe(self) -> str:
        """The degrees in one line, e.g. ``pp 1, dp 4 (2 replicas × 2), sp 1, tp 1`` or ``…, tp 4 (2×2 grid)``."""
        dp = f"dp {self.dp}"
        if self.dp_replicate > 1:
            dp += f" ({self.dp_replicate} replicas × {self.dp_shard})"
        tp = f"tp {self.tp}" + (f" ({self.grid_side}×{self.grid_side} grid)" if self.tp_2d else "")
        return f"pp {self.pp}, {dp}, sp {self.sp}, {tp}"

    def mesh_ranks(self) -> torch.Tensor:
        """The global rank at each mesh coordinate: an int64 tensor of shape ``[pp, dp_replicate,
        dp_shard, sp, tp]`` holding ``rank_order`` (or ``0..world_size-1``) row-major. Needs
        no process group."""
        order = range(self.world_size) if self.rank_order is None else self.rank_order
        return torch.tensor(list(order), dtype=torch.int64).view(tuple(self.degree(axis) for axis in MESH_AXES))

    def axis_groups(self, axis: Axis) -> list[list[int]]:
        """The rank groups along ``axis`` (a mesh axis or a flattened one), each in the axis's
        coordinate order, from :meth:`mesh_ranks` (no process group needed): the ranks that
        ``group(axis)`` connects, for every position of the other axes."""
        inner = [MESH_AXES.index(a) for a in FLATTENED_AXES.get(axis, (axis,))]
        outer = [d for d in range(len(MESH_AXES)) if d not in inner]
        return self.mesh_ranks().permute(*outer, *inner).reshape(-1, self.degree(axis)).tolist()

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The DeviceMesh with the named axes :data:`MESH_AXES` over :meth:`mesh_ranks`; built on
        first use (needs an initialised process group). Axes of size 1 are kept, so code never
        branches on them."""
        return DeviceMesh(self.device_type, self.mesh_ranks(), mesh_dim_names=tuple(str(a) for a in MESH_AXES))

    def _mesh_of(self, axis: Axis) -> DeviceMesh:
        # A flattened axis exists only once its mesh has been built.
        flattened = {Axis.DP_SP: "grad_mesh", Axis.DP_SHARD_SP: "shard_mesh", Axis.TP_ROW: "grid_mesh",
                     Axis.TP_COL: "grid_mesh"}  # fmt: skip
        return getattr(self, flattened[axis]) if axis in flattened else self.mesh

    def group(self, axis: Axis) -> dist.ProcessGroup:
        """The process group of this rank along ``axis`` (a mesh axis or a flattened one)."""
        return self._mesh_of(axis).get_group(str(axis))

    def rank(self, axis: Axis) -> int:
        """This rank's coordinate along ``axis``."""
        return self._mesh_of(axis).get_local_rank(str(axis))

    @property
    def grid_side(self) -> int:
        """``q`` of 2D tensor parallelism's ``q × q`` grid (``tp = q²``); 1 without it."""
        return math.isqrt(self.tp) if self.tp_2d else 1

    def grid_groups(self, axis: Axis) -> list[list[int]]:
        """The rank groups along a grid axis (``TP_ROW``: the ``q`` ranks of a grid column,
        whose row index varies; ``TP_COL``: the ``q`` consecutive tp ranks of a grid row), like
        :meth:`axis_groups`, with no process group. A host-major ``rank_order`` that keeps tp
        inside a host keeps each grid row inside one wherever ``q`` ranks fit in a host.

        Raises:
            ValueError: not 2D, or ``axis`` is not a grid axis.
        """
        if not self.tp_2d or axis not in (Axis.TP_ROW, Axis.TP_COL):
            raise ValueError(f"grid_groups({axis!r}) needs tp_2d and Axis.TP_ROW or Axis.TP_COL")
        q = self.grid_side
        grids = self.axis_groups(Axis.TP)
        return [g[i * q : (i + 1) * q] if axis == Axis.TP_COL else g[i::q] for g in grids for i in range(q)]

    @cached_property
    def grid_mesh(self) -> DeviceMesh:
        """The mesh with ``tp`` unflattened into the named grid axes ``(tp_row, tp_col)`` of
        size ``q`` each (2D tensor parallelism): the six axes ``pp, dp_replicate, dp_shard, sp,
        tp_row, tp_col``. Collective on first use."""
        q = self.grid_side
        return self.mesh._unflatten(str(Axis.TP), (q, q), (str(Axis.TP_ROW), str(Axis.TP_COL)))

    @cached_property
    def grad_mesh(self) -> DeviceMesh:
        """1-D mesh over ``dp_replicate × dp_shard × sp``: the ranks that hold the same
        parameters (same ``pp`` and ``tp`` coordinates) and see different tokens. Gradients
        are averaged over it."""
        return self.mesh[Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.SP]._flatten(Axis.DP_SP)

    @cached_property
    def shard_mesh(self) -> DeviceMesh:
        """1-D mesh over ``dp_shard × sp``: the ranks ZeRO shards model state over (the same
        ranks as :attr:`grad_mesh` when ``dp_replicate == 1``)."""
        return self.mesh[Axis.DP_SHARD, Axis.SP]._flatten(Axis.DP_SHARD_SP)

    @cached_property
    def zero_mesh(self) -> DeviceMesh:
        """2-D mesh ``(dp_replicate, dp_shard_sp)``: where ZeRO places its master shards
        (``Replicate()`` over replica groups, ``Shard(0)`` within one)."""
        _ = self.shard_mesh  # the flattened axis must exist before it can be sliced
        return self.mesh[Axis.DP_REPLICATE, Axis.DP_SHARD_SP]

    @cached_property
    def zero_tp_mesh(self) -> DeviceMesh:
        """3-D mesh ``(dp_replicate, dp_shard_sp, tp)``: where ZeRO places a tensor-parallel
        shard's own shards."""
        _ = self.shard_mesh
        return self.mesh[Axis.DP_REPLICATE, Axis.DP_SHARD_SP, Axis.TP]

    @cached_property
    def shard_tp_mesh(self) -> DeviceMesh:
        """2-D mesh ``(dp_shard_sp, tp)``: where ZeRO places a tensor-parallel shard's own shards
        inside one replica of a local mode (its state is not replicated over ``dp_replicate``:
        each replica trains its own)."""
        _ = self.shard_mesh
        return self.mesh[Axis.DP_SHARD_SP, Axis.TP]

    @cached_property
    def pp_groups(self) -> dict[str, dist.ProcessGroup]:
        """Two process groups over this rank's pipeline ranks (same ``dp``, ``sp``, ``tp``
        coordinates): ``"activation"`` (the mesh's ``pp`` group) and ``"gradient"`` (a second
        group over the same ranks), so forward and backward transfers never share a channel;
        see ``pipeline/p2p.py``. Collective: every rank must call it."""
        mine = None
        for ranks in self.axis_groups(Axis.PP):
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return {"activation": self.group(Axis.PP), "gradient": mine}

    def sequence_slice(self, seq_len: int) -> slice:
        """Positions ``[r·S/sp, (r+1)·S/sp)`` of a length-``seq_len`` sequence that this rank's
        ``sp`` coordinate ``r`` holds (all of them when ``sp == 1``).

        Raises:
            ConfigError: ``seq_len`` not divisible by ``sp``.
        """
        if self.sp == 1:
            return slice(0, seq_len)
        if seq_len % self.sp:
            raise ConfigError(
                f"sequence length {seq_len} is not divisible by parallel.sequence_parallel_degree={self.sp}"
            )
        part = seq_len // self.sp
        start = self.rank(Axis.SP) * part
        return slice(start, start + part)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index in ``0..dp-1`` (replica group major): which
        micro-batches it reads."""
        return self.rank(Axis.DP_REPLICATE) * self.dp_shard + self.rank(Axis.DP_SHARD)

    @property
    def pp_rank(self) -> int:
        return self.rank(Axis.PP)

    def group_or_none(self, axis: Axis) -> dist.ProcessGroup | None:
        """The group along ``axis`` if it has more than one rank, else ``None`` (for the
        collectives that a group of one would only slow down: norm and overflow agreement)."""
        return self.group(axis) if self.degree(axis) > 1 else None
