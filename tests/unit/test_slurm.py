"""The torchrun command line that ``python -m loomtrain.slurm`` builds from SLURM's variables
(no SLURM here: the sbatch script is untested on a real cluster, this is what can be checked)."""

from __future__ import annotations

import pytest

from loomtrain.config import ConfigError
from loomtrain.slurm import expand_nodelist, slurm_torchrun_argv

ENV = {"SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_ID": "4242",
       "SLURM_GPUS_ON_NODE": "8"}  # fmt: skip


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def test_nodelist_expansion_keeps_padding_order_and_plain_names():
    """Catches: a rendezvous endpoint on the wrong node (first node mis-expanded) or lost zero padding."""
    assert expand_nodelist("gpu[07-09,11],login1") == ["gpu07", "gpu08", "gpu09", "gpu11", "login1"]
    assert expand_nodelist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
    with pytest.raises(ConfigError, match="unclosed"):
        expand_nodelist("gpu[01-02")
    with pytest.raises(ConfigError, match="range"):
        expand_nodelist("gpu[3-1]")


def test_each_node_gets_torchrun_with_c10d_rendezvous_on_the_first_node():
    """Catches: a node rank, node count, per-node process count or endpoint that differs
    between nodes of one job (the rendezvous would never complete)."""
    argv = slurm_torchrun_argv(ENV, ["train", "--config", "x.toml"])
    f = flags(argv)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert f["nnodes"] == "3" and f["node-rank"] == "2" and f["nproc-per-node"] == "8"
    assert f["rdzv-backend"] == "c10d" and f["rdzv-endpoint"] == "gpu07:29500" and f["rdzv-id"] == "loomtrain-4242"
    assert f["max-restarts"] == "0"
    assert argv[-5:] == ["-m", "loomtrain.cli", "train", "--config", "x.toml"]


def test_elastic_allows_fewer_nodes_and_restarts():
    """Catches: --elastic passed through to the workers instead of becoming torchrun's node range."""
    argv = slurm_torchrun_argv({**ENV, "LOOMTRAIN_NPROC_PER_NODE": "2"}, ["train", "--elastic"])
    f = flags(argv)
    assert f["nnodes"] == "1:3" and f["max-restarts"] == "3" and f["nproc-per-node"] == "2"
    assert "--elastic" not in argv and argv[-1] == "--checkpoint.resume=auto"


def test_outside_an_allocation_names_the_missing_variable():
    """Catches: a KeyError traceback instead of a clear message when run outside SLURM."""
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST is not set"):
        slurm_torchrun_argv({}, ["train"])
    with pytest.raises(ConfigError, match="SLURM_NNODES=2"):
        slurm_torchrun_argv({**ENV, "SLURM_NNODES": "2"}, ["train"])
