"""Quantizing hooks: fp16/bf16 casts, int8 with a scale per chunk, 1-bit signs with a scale.

- ``fp16``/``bf16``: the gradient is divided by the group size, cast, all-reduced (or
  reduce-scattered) in the low precision and cast back; half the bytes, no error feedback
  (the rounding error is of the order of fp16/bf16's unit roundoff).
- ``int8``: each chunk of ``chunk_size`` elements is sent as int8 values ``round(x/s)`` with
  one fp32 scale ``s = max|x|/127``, so ``|x − s·q| ≤ s/2``; with error feedback.
- ``sign``: 1-bit SGD (Seide et al., Interspeech 2014) in the scaled form of Karimireddy et
  al. (ICML 2019, Algorithm 1, ``C(x) = ‖x‖₁/d · sign(x)``), one scale ``mean|x|`` per chunk;
  8 signs per byte; with error feedback.

Each tensor of a bucket is quantized separately (its own chunks and scales). Quantized
payloads cannot be summed on the wire: each rank all-gathers every rank's payload and scales
(one collective, packed as bytes), decodes them and sums in rank order, so every rank
computes the identical result. Per rank that sends ``(n−1)·payload`` bytes against the
dense all-reduce's ``2·(n−1)/n·4N``: a ratio of ``n/8`` for int8 and ``n/64`` for signs
(plus the scales), so the gain shrinks as the group grows.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loomtrain.compression.feedback import CompressionHook, Pending, same_view
from loomtrain.distributed.data_parallel import CommHook, GradBucket
from loomtrain.distributed.traffic import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _chunked(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``x`` (1-D) zero-padded to whole chunks, as ``[chunks, chunk_size]``."""
    pad = -x.numel() % chunk_size
    return F.pad(x, (0, pad)).view(-1, chunk_size)


def quantize_int8(x: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per chunk.

    Args:
        x: 1-D float tensor of ``N`` elements.
        chunk_size: elements per scale.
    Returns:
        ``q``: int8 ``[N]``, values in [−127, 127]; ``scale``: fp32 ``[ceil(N/chunk_size)]``,
        ``max|x|/127`` of each chunk. ``dequantize_int8`` is within ``scale/2`` of ``x``.
    """
    chunks = _chunked(x.float(), chunk_size)
    scale = chunks.abs().amax(dim=1) / 127
    q = (chunks / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).round_().clamp_(-127, 127)
    return q.to(torch.int8).view(-1)[: x.numel()], scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """fp32 ``[N]`` from :func:`quantize_int8`'s ``q`` ``[N]`` and ``scale``."""
    return (_chunked(q.float(), chunk_size) * scale[:, None]).view(-1)[: q.numel()]


def quantize_sign(x: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled 1-bit quantization: the signs packed 8 per byte and ``mean|x|`` per chunk.

    Args:
        x: 1-D float tensor of ``N`` elements (a zero counts as positive).
        chunk_size: elements per scale.
    Returns:
        ``bits``: uint8 ``[ceil(N/8)]`` (bit ``i % 8`` of byte ``i // 8`` is 1 where
        ``x[i] >= 0``); ``scale``: fp32 ``[ceil(N/chunk_size)]``, each chunk's ``‖x‖₁/d``.
    """
    x = x.float()
    counts = torch.full((-(-x.numel() // chunk_size),), chunk_size, dtype=torch.float32, device=x.device)
    counts[-1] = x.numel() - (counts.numel() - 1) * chunk_size
    scale = _chunked(x.abs(), chunk_size).sum(dim=1) / counts
    positive = _chunked((x >= 0).to(torch.uint8), 8)
    bits = (positive * _BIT_WEIGHTS.to(x.device)).sum(dim=1, dtype=torch.uint8)
    return bits, scale


def dequantize_sign(bits: torch.Tensor, scale: torch.Tensor, numel: int, chunk_size: int) -> torch.Tensor:
    """fp32 ``[numel]``: ``±scale`` of each element's chunk, from :func:`quantize_sign`."""
    positive = (bits[:, None] & _BIT_WEIGHTS.to(bits.device)) != 0
    signs = positive.view(-1)[:numel].float().mul_(2).sub_(1)
    return (_chunked(signs, chunk_size) * scale[:, None]).view(-1)[:numel]


class CastHook(CommHook):
    """Average in ``dtype`` (fp16 or bf16): divide by the group size first (so fp16 cannot
    overflow in the sum more than the mean could), cast, reduce, cast back."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.method = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def reduce(self, bucket: GradBucket, group: dist.ProcessGroup) -> Pending:
        n = dist.get_world_size(group)
        low = bucket.buffer.div_(n).to(self.dtype)
        self.dense_bytes += all_reduce_bytes(bucket.nbytes, n)
        self.bytes_sent += all_reduce_bytes(low.numel() * low.element_size(), n)
        work = dist.all_reduce(low, group=group, async_op=True)
        return Pending(work, lambda: bucket.buffer.copy_(low))

    def reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup, bucket: GradBucket | None = None
    ) -> Pending:
        n = dist.get_world_size(group)
        low = flat.div_(n).to(self.dtype)
        low_out = torch.empty(out.numel(), dtype=self.dtype, device=out.device)
        self.dense_bytes += reduce_scatter_bytes(flat.numel() * flat.element_size(), n)
        self.bytes_sent += reduce_scatter_bytes(low.numel() * low.element_size(), n)
        work = dist.reduce_scatter_single(low_out, low, group=group, async_op=True)
        return Pending(work, lambda: out.copy_(low_out))


class _GatherQuantized(CompressionHook):
    """Error feedback around a quantizer whose payloads are all-gathered and summed decoded.

    Each tensor of the bucket is quantized on its own, so a chunk never mixes tensors of
    different magnitudes (a norm weight's small gradient sharing a scale with a large one would
    round to zero). A tensor's payload is bytes: its fp32 scales, then its quantized values;
    the bucket's payload is the tensors' payloads back to back.
    """

    def __init__(self, chunk_size: int, warmup_steps: int = 0):
        super().__init__(warmup_steps)
        self.chunk_size = chunk_size

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 payload of 1-D fp32 ``x``."""

    @abstractmethod
    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """fp32 ``[numel]`` from a payload made by :meth:`_encode`."""

    @abstractmethod
    def _value_bytes(self, numel: int) -> int:
        """Bytes of the quantized values of ``numel`` elements."""

    def _n_scales(self, numel: int) -> int:
        return -(-numel // self.chunk_size)

    def _scales(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        # A copy: a payload starts at any byte offset, and a float32 view needs 4-byte alignment.
        return payload[: 4 * self._n_scales(numel)].clone().view(torch.float32)

    def _encode_bucket(self, bucket: GradBucket, delta: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._encode(same_view(m, bucket.buffer, delta).reshape(-1)) for m in bucket.matrices])

    def _decode_bucket(self, bucket: GradBucket, payload: torch.Tensor) -> torch.Tensor:
        """fp32, shaped like ``bucket.buffer``, from a payload of :meth:`_encode_bucket`."""
        out = torch.zeros(bucket.buffer.shape, dtype=torch.float32, device=payload.device)
        start = 0
        for m in bucket.matrices:
            size = 4 * self._n_scales(m.numel()) + self._value_bytes(m.numel())
            same_view(m, bucket.buffer, out).copy_(self._decode(payload[start : start + size], m.numel()).view(m.shape))
            start += size
        return out

    def _start(self, bucket: GradBucket, group: dist.ProcessGroup) -> Pending:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        delta = self.feedback.accumulate(bucket.index, bucket.buffer)
        payload = self._encode_bucket(bucket, delta)
        sent = self._decode_bucket(bucket, payload)
        delta.sub_(sent)
        size = payload.numel()
        gathered = torch.empty(n * size, dtype=torch.uint8, device=payload.device)
        parts = [gathered.narrow(0, r * size, size) for r in range(n)]
        work = dist.all_gather(parts, payload, group=group, async_op=True)
        self.bytes_sent += all_gather_bytes(gathered.numel(), n)

        def finish() -> torch.Tensor:
            # In rank order, so every rank forms the identical sum (this rank's own part is
            # decoded already: the same bytes give the same values).
            total = torch.zeros_like(sent)
            for r, part in enumerate(parts):
                total += sent if r == rank else self._decode_bucket(bucket, part)
            return bucket.buffer.copy_(total.div_(n))

        return Pending(work, finish)


class Int8Hook(_GatherQuantized):
    """int8 values with an fp32 scale per ``chunk_size`` elements of each tensor, with error feedback."""

    method = "int8"

    def _value_bytes(self, numel: int) -> int:
        return numel

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_int8(x, self.chunk_size)
        return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)])

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        q = payload[4 * self._n_scales(numel) :].view(torch.int8)
        return dequantize_int8(q, self._scales(payload, numel), self.chunk_size)


class SignHook(_GatherQuantized):
    """Signs (1 bit each) with an fp32 ``mean|x|`` per ``chunk_size`` elements of each tensor,
    with error feedback."""

    method = "sign"

    def _value_bytes(self, numel: int) -> int:
        return -(-numel // 8)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        bits, scale = quantize_sign(x, self.chunk_size)
        return torch.cat([scale.view(torch.uint8), bits])

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        bits = payload[4 * self._n_scales(numel) :]
        return dequantize_sign(bits, self._scales(payload, numel), numel, self.chunk_size)
