"""The one owner of the process layout: degrees, the DeviceMesh and its process groups.

Every other module asks this object for ranks and groups instead of doing rank arithmetic.
Mesh axes, outermost first; the innermost axes talk most, so they get adjacent ranks (on
one node, the fastest links):

- ``pp``: pipeline parallel. Each pipeline rank holds some of the layers (its stages) and
  sends activations to the next rank, gradients to the previous one: the least traffic, so
  outermost (across nodes when there are several).
- ``dp``: data parallel. Replicas (ZeRO stage 0) or shards (stages 1–3) of the model state;
  gradients are reduced over it. Each dp rank reads different micro-batches.
- ``sp``: Ulysses sequence parallel (Jacobs et al. 2023): each rank holds a slice of the
  sequence; attention switches to a head split by all-to-all.
- ``tp``: tensor parallel (Shoeybi et al. 2019, Megatron-LM): weight matrices split across
  ranks; Megatron sequence parallelism (Korthikanti et al. 2022) runs on this axis too.

The ``sp`` ranks of one ``dp`` index hold the same parameters and different tokens, so
gradients are reduced, and ZeRO shards model state, over ``dp`` and ``sp`` together: the
flattened ``dp_sp`` axis (:attr:`ParallelDims.grad_mesh`), within one pipeline rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement

from loomtrain.config import ConfigError, ParallelConfig

AXES = ("pp", "dp", "sp", "tp")


def shard_range(size: int, n: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s part of a dimension of ``size`` split over ``n`` ranks
    in the chunk layout of ``torch.chunk`` and DTensor ``Shard`` (``ceil(size / n)`` per rank,
    trailing ranks fewer or none). Tensor parallelism and ZeRO both split this way."""
    per_rank = math.ceil(size / n)
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
    """Parallel degrees for ``world_size`` processes; ``pp × dp × sp × tp == world_size``.

    Raises:
        ConfigError: a degree below 1, or degrees that do not multiply to ``world_size``.
    """

    dp: int
    world_size: int
    tp: int = 1
    sp: int = 1
    pp: int = 1
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        for name, value in (("data_parallel_degree", self.dp), ("tensor_parallel_degree", self.tp),
                            ("sequence_parallel_degree", self.sp),
                            ("pipeline_parallel_degree", self.pp)):  # fmt: skip
            if value < 1:
                raise ConfigError(f"parallel.{name}={value} must be at least 1")
        product = self.pp * self.dp * self.sp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees pp={self.pp} × dp={self.dp} × sp={self.sp} × tp={self.tp} = {product} "
                f"do not multiply to the world size {self.world_size}; change parallel.* or the process count"
            )

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, device_type: str = "cpu") -> ParallelDims:
        """Degrees from ``[parallel]``; ``data_parallel_degree=-1`` takes what pp, tp and sp leave.

        Raises:
            ConfigError: the world size is not divisible by ``pp × tp × sp``, or degrees mismatch.
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
        return cls(dp=dp, world_size=world_size, tp=tp, sp=sp, pp=pp, device_type=device_type)

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The DeviceMesh with named axes ``("pp", "dp", "sp", "tp")``; built on first use (needs an
        initialised process group). Axes of size 1 are kept, so code never branches on them."""
        return init_device_mesh(self.device_type, (self.pp, self.dp, self.sp, self.tp), mesh_dim_names=AXES)

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank along ``axis`` (one of ``AXES``)."""
        return self.mesh.get_group(axis)

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self.mesh.get_local_rank(axis)

    @cached_property
    def grad_mesh(self) -> DeviceMesh:
        """1-D mesh over the ``dp`` and ``sp`` axes together: the ranks that hold the same
        parameters (same ``tp`` coordinate) and see different tokens. Gradients are averaged,
        and ZeRO shards model state, over it."""
        return self.mesh["dp", "sp"]._flatten("dp_sp")

    @cached_property
    def grad_tp_mesh(self) -> DeviceMesh:
        """2-D mesh ``(dp_sp, tp)``: where ZeRO places a tensor-parallel shard's own shards."""
        _ = self.grad_mesh  # the flattened dp_sp axis must exist before it can be sliced
        return self.mesh["dp_sp", "tp"]

    @cached_property
    def pp_groups(self) -> dict[str, dist.ProcessGroup]:
        """Two process groups over this rank's pipeline ranks (same ``dp``, ``sp``, ``tp``
        coordinates): ``"activation"`` (the mesh's ``pp`` group) and ``"gradient"`` (a second
        group over the same ranks), so forward and backward transfers never share a channel;
        see ``pipeline/p2p.py``. Collective: every rank must call it."""
        lines = self.mesh.mesh.movedim(0, -1).reshape(-1, self.pp).tolist()
        mine = None
        for ranks in lines:
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return {"activation": self.group("pp"), "gradient": mine}

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
        start = self.rank("sp") * part
        return slice(start, start + part)

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.rank("pp")
