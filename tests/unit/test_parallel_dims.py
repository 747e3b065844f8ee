"""ParallelDims: degrees checked before any process group exists."""

import pytest

from loomtrain.config import ConfigError, ParallelConfig
from loomtrain.distributed.parallel_dims import ParallelDims


def test_data_parallel_degree_fills_what_tp_and_sp_leave():
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_degree=2), world_size=8)
    assert (dims.dp, dims.sp, dims.tp) == (4, 1, 2)


def test_world_not_divisible_by_tp_times_sp_is_rejected():
    with pytest.raises(ConfigError, match="tensor_parallel_degree=4"):
        ParallelDims.from_config(ParallelConfig(tensor_parallel_degree=4), world_size=6)


def test_explicit_degrees_must_multiply_to_world_size():
    cfg = ParallelConfig(data_parallel_degree=3, tensor_parallel_degree=2)
    with pytest.raises(ConfigError, match="do not multiply to the world size 4"):
        ParallelDims.from_config(cfg, world_size=4)
