"""The one owner of the process layout: degrees, the DeviceMesh and its process groups.

Every other module asks this object for ranks and groups instead of doing rank arithmetic.
Axes, outermost first (the order a later mesh keeps, so that the innermost axes, which
communicate most, stay on the fastest links):

- ``dp``: data parallel (replicas of the model that all-reduce gradients).

Tensor, sequence and pipeline axes join this list as they are implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from loomtrain.config import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees for ``world_size`` processes.

    Raises:
        ConfigError: the degrees do not multiply to ``world_size``.
    """

    dp: int
    world_size: int
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.dp < 1 or self.dp != self.world_size:
            raise ConfigError(
                f"data parallel degree dp={self.dp} must equal the world size {self.world_size} "
                "(only data parallelism is available so far)"
            )

    @classmethod
    def from_world(cls, world_size: int, device_type: str = "cpu") -> ParallelDims:
        return cls(dp=world_size, world_size=world_size, device_type=device_type)

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The DeviceMesh with named axes; built on first use (needs an initialised process group)."""
        return init_device_mesh(self.device_type, (self.dp,), mesh_dim_names=("dp",))

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")
