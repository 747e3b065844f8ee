"""Gradient compression behind the :class:`~loomtrain.distributed.data_parallel.CommHook` seam.

Chosen by ``compression.method`` (see ``docs/compression.md``): ``fp16``/``bf16`` casts,
``int8`` and ``sign`` quantization, ``topk`` sparsification (Deep Gradient Compression) and
``powersgd`` low-rank compression; all but the casts keep error-feedback residuals, which
:meth:`CommHook.state_dict` carries into each rank's checkpoint file. Every hook works under
plain data parallelism (``reduce``) and ZeRO (``reduce_scatter``).
"""

from __future__ import annotations

import torch

from loomtrain.compression.feedback import CompressionHook, ErrorFeedback, Pending
from loomtrain.compression.powersgd import PowerSGDHook
from loomtrain.compression.quantize import CastHook, Int8Hook, SignHook
from loomtrain.compression.topk import TopKHook
from loomtrain.config import CompressionConfig
from loomtrain.distributed.collectives import host_hook
from loomtrain.distributed.data_parallel import AllReduceHook, CommHook
from loomtrain.distributed.mixed_precision import DTYPES
from loomtrain.distributed.topology import Topology

__all__ = [
    "CastHook",
    "CompressionHook",
    "ErrorFeedback",
    "Int8Hook",
    "Pending",
    "PowerSGDHook",
    "SignHook",
    "TopKHook",
    "build_comm_hook",
]


def build_comm_hook(cfg: CompressionConfig, comm_hook: str = "allreduce", topology: Topology | None = None) -> CommHook:
    """The communication hook for ``cfg`` and ``data_parallel.comm_hook``: the compressor with
    ``cfg``'s parameters (``AllReduceHook`` when ``cfg.method`` is ``"none"``), used as is
    (``"allreduce"``) or inside a :class:`HierarchicalHook` (``"hierarchical"``: it then
    compresses only what crosses hosts) or an :class:`AutoHook` (``"auto"``), which read
    ``topology``.

    Raises:
        ValueError: ``"hierarchical"`` or ``"auto"`` without a topology.
    """
    return host_hook(comm_hook, topology, _compressor(cfg))


def _compressor(cfg: CompressionConfig) -> CommHook:
    factories = {
        "none": AllReduceHook,
        "fp16": lambda: CastHook(torch.float16),
        "bf16": lambda: CastHook(torch.bfloat16),
        "int8": lambda: Int8Hook(cfg.chunk_size, cfg.warmup_steps),
        "sign": lambda: SignHook(cfg.chunk_size, cfg.warmup_steps),
        "topk": lambda: TopKHook(
            cfg.topk_ratio, cfg.min_compress_numel, cfg.momentum_correction, cfg.warmup_steps, cfg.topk_warmup_density
        ),
        "powersgd": lambda: PowerSGDHook(
            cfg.powersgd_rank, cfg.min_compress_numel, cfg.warmup_steps, wire_dtype=DTYPES[cfg.powersgd_dtype]
        ),
    }
    return factories[cfg.method]()
