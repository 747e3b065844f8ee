"""PowerSGD: rank-r gradient compression by one step of power iteration, with error feedback.

Source: Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), Algorithm 1 (compression), Algorithm 2 (error
feedback), §3 (warm start: each step's power iteration starts from the previous step's Q).

Per gradient matrix ``M`` (``rows × cols``, this rank's gradient plus residual) with rank
``r' = min(r, rows, cols)`` and a ``cols × r'`` matrix ``Q`` common to all ranks::

    P ← M·Q;  P ← Σ_ranks P (all-reduce);  P̂ ← orthonormal basis of P (QR)
    Q_i ← Mᵀ·P̂;  Q ← mean_ranks Q_i (all-reduce);  update ← P̂·Qᵀ = P̂·P̂ᵀ·mean(M)

Rank ``i`` has sent ``P̂·Q_iᵀ`` (their mean is the update); its residual is what is left,
``M − P̂·Q_iᵀ``. Unlike quantization and Top-K, P and Q are linear in the gradient, so they
are summed by all-reduce and the cost does not grow with the number of ranks. With
``r' = min(rows, cols)`` P̂ spans M's whole column space and the update is exact.

Tensors that are 1-D (biases, norm weights), or have fewer than ``min_compress_numel``
elements, are sent dense, packed into the same all-reduce as the P matrices: two all-reduces
per bucket in all. Note that a matrix only gets smaller if ``r'·(rows+cols) < rows·cols``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loomtrain.compression.feedback import CompressionHook, Pending, same_view
from loomtrain.distributed.data_parallel import GradBucket
from loomtrain.distributed.traffic import all_reduce_bytes


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis ``[rows, r]`` of the columns of ``p`` ``[rows, r]`` (rows ≥ r), by
    Householder QR (deterministic, and stable where Gram-Schmidt loses orthogonality)."""
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGDHook(CompressionHook):
    """Rank-``rank`` PowerSGD with error feedback and warm-started Q.

    Args:
        rank: target rank ``r`` (each matrix uses ``min(r, rows, cols)``).
        min_compress_numel: tensors with fewer elements are sent dense.
        warmup_steps: steps reduced densely first.
        seed: seeds the initial Q (standard normal), identical on every rank.
        wire_dtype: the dtype P, Q and the dense tensors are all-reduced in. With bf16 each
            rank's residual keeps what rounding its own P, Q and dense tensors lost (its Q is
            rounded before ``M − P̂·Q_iᵀ`` is formed); the roundings of the partial sums inside
            the 16-bit collective (n−1 of them in a ring) are not fed back.
    """

    method = "powersgd"

    def __init__(
        self,
        rank: int,
        min_compress_numel: int = 0,
        warmup_steps: int = 0,
        seed: int = 0,
        wire_dtype: torch.dtype = torch.float32,
    ):
        super().__init__(warmup_steps)
        self.rank, self.min_compress_numel, self.seed = rank, min_compress_numel, seed
        self.wire_dtype = wire_dtype
        self.qs: dict[int, dict[int, torch.Tensor]] = {}

    def _compressed(self, m: torch.Tensor) -> bool:
        rows, cols = m.numel() // m.shape[-1], m.shape[-1]
        return rows > 1 and cols > 1 and m.numel() >= self.min_compress_numel

    def _q(self, bucket: int, j: int, cols: int, rows: int) -> torch.Tensor:
        shape = (cols, min(self.rank, rows, cols))
        q = self.qs.setdefault(bucket, {}).get(j)
        if q is None or q.shape != shape:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + bucket * 1009 + j)
            q = self.qs[bucket][j] = torch.randn(shape, generator=g)
        return q

    def _start(self, bucket: GradBucket, group: dist.ProcessGroup) -> Pending:
        n = dist.get_world_size(group)
        delta = self.feedback.accumulate(bucket.index, bucket.buffer)
        views = [same_view(m, bucket.buffer, delta) for m in bucket.matrices]
        low = [j for j, v in enumerate(views) if self._compressed(v)]
        dense = [j for j, v in enumerate(views) if not self._compressed(v)]
        ms = {j: views[j].reshape(-1, views[j].shape[-1]) for j in low}
        qs = {j: self._q(bucket.index, j, ms[j].shape[1], ms[j].shape[0]).to(delta.device) for j in low}
        ps = {j: ms[j] @ qs[j] for j in low}
        sizes = [ps[j].numel() for j in low] + [views[j].numel() for j in dense]
        first = torch.cat([ps[j].reshape(-1) for j in low] + [views[j].reshape(-1) for j in dense]).to(self.wire_dtype)
        for j, sent in zip(dense, first.split(sizes)[len(low) :], strict=True):
            views[j].sub_(sent.view_as(views[j]))  # the residual keeps what rounding to wire_dtype lost
        work = dist.all_reduce(first, group=group, async_op=True)
        self.bytes_sent += all_reduce_bytes(first.numel() * first.element_size(), n)

        def finish() -> torch.Tensor:
            parts = iter(first.float().split(sizes))
            p_hats = {j: orthonormalize(next(parts).view_as(ps[j])) for j in low}
            for j in dense:
                _write(bucket, j, next(parts).div(n))
            if low:
                second = torch.cat([(ms[j].T @ p_hats[j]).reshape(-1) for j in low]).to(self.wire_dtype)
                q_sizes = [qs[j].numel() for j in low]
                for j, q_sent in zip(low, second.float().split(q_sizes), strict=True):
                    views[j].copy_((ms[j] - p_hats[j] @ q_sent.view_as(qs[j]).T).view_as(views[j]))
                dist.all_reduce(second, group=group)
                self.bytes_sent += all_reduce_bytes(second.numel() * second.element_size(), n)
                for j, q in zip(low, second.float().div_(n).split(q_sizes), strict=True):
                    self.qs[bucket.index][j] = q.view_as(qs[j]).clone()
                    _write(bucket, j, p_hats[j] @ self.qs[bucket.index][j].T)
            return bucket.buffer

        return Pending(work, finish)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "qs": {b: dict(q) for b, q in self.qs.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.qs = {b: dict(q) for b, q in state["qs"].items()}


def _write(bucket: GradBucket, j: int, value: torch.Tensor) -> None:
    """Copy ``value`` (any shape with the same elements) into matrix ``j`` of ``bucket.buffer``."""
    target = bucket.matrices[j]
    target.copy_(value.reshape(target.shape))
