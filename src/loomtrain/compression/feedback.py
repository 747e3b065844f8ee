"""What every compressing hook shares: error feedback, dense warm-up, byte counting, ZeRO support.

Error feedback: a compressor ``C`` that drops information (quantization, sparsification,
low rank) is applied not to the gradient ``g`` but to ``Δ = g + e``, and what it could not send,
``e ← Δ − C(Δ)``, is kept and added to the next step's gradient. Nothing is lost, only
delayed: after ``T`` steps, the sum of what was sent plus ``e`` equals the sum of the true
gradients. Sources: Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs" (Interspeech 2014), §3 ("error feedback");
Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes"
(ICML 2019), Algorithm 2 (EF-SGD), which proves it restores SGD's convergence rate.

Byte counts use the per-rank send volumes of the bandwidth-optimal algorithms, computed by
``loomtrain.distributed.traffic``: all-reduce ``2·(n−1)/n·M``, all-gather ``(n−1)/n·M`` of the
gathered output ``M``, reduce-scatter ``(n−1)/n·M`` of the input.
"""

from __future__ import annotations

import logging
from abc import abstractmethod

import torch
import torch.distributed as dist

from loomtrain.distributed.data_parallel import CommHook, GradBucket, Pending
from loomtrain.distributed.traffic import all_reduce_bytes, reduce_scatter_bytes

log = logging.getLogger(__name__)


class ErrorFeedback:
    """Residuals ``e`` (fp32, one per bucket index), the memory of error feedback."""

    def __init__(self) -> None:
        self.residuals: dict[int, torch.Tensor] = {}

    def accumulate(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        """Add ``grad`` to residual ``key`` in place and return it: ``Δ = g + e``.

        The caller compresses the returned tensor, then subtracts what it sent from it in
        place; what remains is the next step's residual. A residual of another shape (a
        checkpoint from another bucket layout) is dropped with a warning.
        """
        e = self.residuals.get(key)
        if e is not None and e.shape != grad.shape:
            log.warning(
                "error-feedback residual of bucket %d has shape %s, the gradient %s: starting it at zero",
                key, tuple(e.shape), tuple(grad.shape),
            )  # fmt: skip
            e = None
        if e is None:
            e = self.residuals[key] = grad.to(torch.float32, copy=True)
            return e
        return e.add_(grad)


class CompressionHook(CommHook):
    """A :class:`CommHook` that compresses with error feedback.

    For the first ``warmup_steps`` optimizer steps it reduces densely (a plain all-reduce or
    reduce-scatter), as Deep Gradient Compression's warm-up does (Lin et al., ICLR 2018, §3.4):
    early gradients change fast and are worth sending whole. Under ZeRO stages 2 and 3 the
    compressed reduction yields the whole averaged buffer and the rank keeps its part (the
    compressors here all form the dense sum anyway).

    Subclasses implement :meth:`_start`. State (:meth:`state_dict`): the step count and the
    residuals, plus what subclasses add.
    """

    def __init__(self, warmup_steps: int = 0):
        super().__init__()
        self.warmup_steps = warmup_steps
        self.feedback = ErrorFeedback()

    @abstractmethod
    def _start(self, bucket: GradBucket, group: dist.ProcessGroup) -> Pending:
        """Compress ``bucket.buffer`` (plus its residual) and launch the exchange; the
        returned handle's ``wait()`` writes the averaged gradient into ``bucket.buffer``
        and returns it. Adds the bytes sent to ``bytes_sent``."""

    @property
    def warming_up(self) -> bool:
        return self.steps < self.warmup_steps

    def reduce(self, bucket: GradBucket, group: dist.ProcessGroup) -> Pending | torch.futures.Future:
        """Averaged, compressed all-reduce of ``bucket.buffer`` (dense during warm-up)."""
        n = dist.get_world_size(group)
        self.dense_bytes += all_reduce_bytes(bucket.nbytes, n)
        if self.warming_up:
            bucket.buffer.div_(n)
            self.bytes_sent += all_reduce_bytes(bucket.nbytes, n)
            return dist.all_reduce(bucket.buffer, group=group, async_op=True).get_future()
        return self._start(bucket, group)

    def reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup, bucket: GradBucket | None = None
    ) -> Pending | dist.Work:
        """ZeRO stages 2-3: the compressed reduction of the whole ``flat``, of which this rank
        keeps its part in ``out`` (dense reduce-scatter during warm-up).

        Raises:
            ValueError: no ``bucket`` given (its index keys the residual).
        """
        if bucket is None:
            raise ValueError(f"{type(self).__name__}.reduce_scatter needs the GradBucket wrapping flat")
        if self.warming_up:
            return super().reduce_scatter(flat, out, group)
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.dense_bytes += reduce_scatter_bytes(flat.numel() * flat.element_size(), n)
        return self._start(bucket, group).then(lambda full: out.copy_(full.view(n, -1)[rank]))

    def state_dict(self) -> dict:
        return {"steps": self.steps, "residuals": dict(self.feedback.residuals)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self.feedback.residuals = dict(state["residuals"])


def same_view(view: torch.Tensor, base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The view of ``other`` that ``view`` is of ``base`` (same shape, strides and offset);
    ``base`` and ``other`` are contiguous 1-D tensors of the same length."""
    offset = other.storage_offset() + view.storage_offset() - base.storage_offset()
    return other.as_strided(view.shape, view.stride(), offset)
