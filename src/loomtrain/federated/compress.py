"""Compression of a client's model update before it is sent, with error feedback on the client.

Methods (``--compress``): ``none``; ``int8`` (symmetric per-chunk int8, loomtrain's
:func:`~loomtrain.compression.quantize.quantize_int8`); ``topk`` (the ``ratio·N`` largest
magnitudes with their int32 indices, :func:`~loomtrain.compression.topk.topk_indices`). What a
lossy method leaves out is kept by the client and added to its next update (error feedback:
Seide et al., "1-bit SGD", Interspeech 2014; Karimireddy et al., "Error Feedback Fixes SignSGD",
ICML 2019, Algorithm 2), so nothing is lost, only delayed.

The residual lives with the client (its Flower ``Context.state``), never on the server.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loomtrain.compression.quantize import dequantize_int8, quantize_int8
from loomtrain.compression.topk import topk_indices

METHODS = ("none", "int8", "topk")


@dataclass
class CompressedUpdate:
    """An update as sent: ``values`` (float32 ``[N]`` for ``none``, int8 ``[N]`` for ``int8``,
    float32 ``[k]`` for ``topk``), ``scales`` (float32 per chunk, ``int8`` only), ``indices``
    (int32 ``[k]``, ``topk`` only) and the dense size ``size`` = N."""

    method: str
    size: int
    values: np.ndarray
    scales: np.ndarray | None = None
    indices: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire (values, scales and indices)."""
        return sum(a.nbytes for a in (self.values, self.scales, self.indices) if a is not None)

    def arrays(self) -> dict[str, np.ndarray]:
        """The non-empty arrays by name, for a Flower ``ArrayRecord``."""
        named = {"values": self.values, "scales": self.scales, "indices": self.indices}
        return {k: v for k, v in named.items() if v is not None}

    def decode(self, chunk_size: int) -> np.ndarray:
        """The dense float32 ``[size]`` update this payload stands for.

        Raises:
            ValueError: indices out of range or values of the wrong length (a malformed payload).
        """
        if self.method == "none":
            out = self.values.astype(np.float32)
        elif self.method == "int8":
            q, s = torch.from_numpy(self.values.astype(np.int8)), torch.from_numpy(self.scales.astype(np.float32))
            out = dequantize_int8(q, s, chunk_size).numpy()
        else:
            if (
                self.indices is None
                or len(self.indices) != len(self.values)
                or self.indices.max(initial=0) >= self.size
            ):
                raise ValueError(f"top-k payload: {len(self.values)} values for indices outside [0, {self.size})")
            out = np.zeros(self.size, np.float32)
            out[self.indices] = self.values
        if out.shape != (self.size,):
            raise ValueError(f"{self.method} payload decodes to {out.shape[0]} values, expected {self.size}")
        return out


def compress(update: np.ndarray, residual: np.ndarray | None, method: str, topk_ratio: float = 0.01,
             chunk_size: int = 1024) -> tuple[CompressedUpdate, np.ndarray | None]:  # fmt: skip
    """Compress ``update`` + ``residual`` and return (payload, new residual).

    Shapes: ``update`` float32 ``[N]``; ``residual`` float32 ``[N]`` or ``None`` (zero). The new
    residual is ``Δ − decode(payload)`` with ``Δ = update + residual`` (``None`` for ``none``).

    Raises:
        ValueError: unknown ``method`` (``--compress``), ``topk_ratio`` outside (0, 1], or a
            residual of another size than the update (a model that changed shape).
    """
    if method not in METHODS:
        raise ValueError(f"--compress {method!r} is not a method; use one of {', '.join(METHODS)}")
    if method == "none":
        return CompressedUpdate("none", update.size, update.astype(np.float32)), None
    if residual is not None and residual.shape != update.shape:
        raise ValueError(f"error-feedback residual has {residual.size} values, the update {update.size}")
    delta = update.astype(np.float32) + (0 if residual is None else residual)
    if method == "int8":
        q, scale = quantize_int8(torch.from_numpy(delta), chunk_size)
        payload = CompressedUpdate("int8", delta.size, q.numpy(), scales=scale.numpy())
    else:
        if not 0 < topk_ratio <= 1:
            raise ValueError(f"--topk-ratio {topk_ratio}: must lie in (0, 1]")
        k = max(1, int(topk_ratio * delta.size))
        idx = topk_indices(torch.from_numpy(delta), k).numpy().astype(np.int32)
        payload = CompressedUpdate("topk", delta.size, delta[idx], indices=idx)
    return payload, delta - payload.decode(chunk_size)
