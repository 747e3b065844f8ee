"""Joining the process group the launcher describes, on the right device."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from loomtrain.config import Config, ConfigError
from loomtrain.distributed.parallel_dims import launch_env
from loomtrain.distributed.spawn import free_port


def select_device(cfg: Config) -> torch.device:
    """CUDA (this process's local GPU) when asked or available under ``device="auto"``, else CPU;
    ``run.rank_devices`` names each rank's device type instead (a mixed CPU + CUDA job).

    Raises:
        ConfigError: ``run.device='cuda'`` with no CUDA device visible.
    """
    env = launch_env()
    if cfg.run.rank_devices:
        want_cuda = cfg.run.rank_devices[env.rank] == "cuda"
    else:
        want_cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("run.device='cuda' but no CUDA device is visible; use run.device='cpu' or 'auto'")
    return torch.device("cuda", env.local_rank % torch.cuda.device_count())


def init_distributed(cfg: Config, device: torch.device) -> None:
    """Join the process group that the launcher described in the environment (if not yet
    joined), with the configured collective timeout (``distributed.timeout_s`` seconds); one
    thread per process on CPU. Without a launcher: a group of one process on a free port."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    backend = cfg.distributed.backend
    if backend == "auto":
        # NCCL only joins CUDA ranks; a job mixing CPU and CUDA ranks talks through gloo.
        mixed = len(set(cfg.run.rank_devices)) > 1
        backend = "nccl" if device.type == "cuda" and not mixed else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    env = launch_env()
    dist.init_process_group(
        backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=cfg.distributed.timeout_s)
    )
