"""Point-to-point transport between neighbouring pipeline ranks.

Activations go forward on one process group and gradients backward on another (two groups
over the same ranks): NCCL matches sends to receives in issue order per communicator, with
no tags, so keeping the two kinds apart makes each channel's order the schedule's order,
which :func:`~loomtrain.distributed.pipeline.schedule.check_schedule` verifies.

Shapes and dtypes are agreed once per channel: the first message a rank sends on a channel
is a small header (rank count, sizes, dtype code); the receiver keeps it and allocates every
later buffer from it. Sends are non-blocking and complete at the end of the step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loomtrain.distributed.traffic import Traffic

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # ndim, up to 6 sizes, dtype code


class PipelineComm:
    """Sends and receives of one pipeline rank.

    Args:
        groups: ``{"activation": group, "gradient": group}``, both over this rank's pipeline ranks.
        pp_rank: this rank's coordinate on the pipeline axis; ``pp``: the pipeline degree.
        device: where received buffers are allocated.
        traffic: where payload bytes sent are counted, on axis ``"pp"`` (headers excluded).
    """

    def __init__(self, groups: dict[str, dist.ProcessGroup], pp_rank: int, pp: int, device: torch.device,
                 traffic: Traffic | None = None):  # fmt: skip
        self.groups, self.pp_rank, self.pp, self.device = groups, pp_rank, pp, device
        self.traffic = traffic if traffic is not None else Traffic()
        self._sent_meta: dict[tuple[int, str], tuple] = {}
        self._recv_meta: dict[tuple[int, str], tuple] = {}
        self._pending_sends: list[tuple[dist.Work, torch.Tensor]] = []

    @classmethod
    def consecutive(cls, pp: int) -> PipelineComm:
        """This rank's channels in its pipeline of ``pp`` consecutive ranks of the default group
        (ranks ``0..pp-1`` form one pipeline, ``pp..2pp-1`` the next, ...), on CPU. Every rank must
        call it: it creates every pipeline's groups, as ``new_group`` requires.

        Raises:
            ValueError: the world size is not a multiple of ``pp``.
        """
        world, rank, mine = dist.get_world_size(), dist.get_rank(), None
        if world % pp:
            raise ValueError(f"{world} ranks do not form pipelines of {pp}")
        for first in range(0, world, pp):
            ranks = list(range(first, first + pp))
            groups = {"activation": dist.new_group(ranks), "gradient": dist.new_group(ranks)}
            if rank in ranks:
                mine = cls(groups, rank - first, pp, torch.device("cpu"))
        return mine

    def _global(self, pp_rank: int, kind: str) -> int:
        return dist.get_global_rank(self.groups[kind], pp_rank)

    def send(self, tensor: torch.Tensor, to_pp_rank: int, kind: str) -> None:
        """Start sending ``tensor`` (activation or gradient) to pipeline rank ``to_pp_rank``.

        Raises:
            RuntimeError: the tensor's shape or dtype differs from the first one sent on this
                channel (the receiver allocates from that one).
        """
        tensor = tensor.detach().contiguous()
        meta = (tuple(tensor.shape), tensor.dtype)
        key = (to_pp_rank, kind)
        known = self._sent_meta.get(key)
        if known is None:
            self._sent_meta[key] = meta
            self._isend(self._header(*meta), to_pp_rank, kind)
        elif known != meta:
            raise RuntimeError(
                f"pipeline {kind} to rank {to_pp_rank} changed from {known} to {meta}; every micro-batch "
                "must have the same shape (micro_batch_size × seq_len)"
            )
        self._isend(tensor, to_pp_rank, kind)
        self.traffic.point_to_point("pp", tensor.numel() * tensor.element_size())

    def _isend(self, tensor: torch.Tensor, to_pp_rank: int, kind: str) -> None:
        work = dist.isend(tensor, dst=self._global(to_pp_rank, kind), group=self.groups[kind])
        self._pending_sends.append((work, tensor))  # the buffer must outlive the transfer

    def agreed(self, from_pp_rank: int, kind: str) -> bool:
        """Whether the header of this channel has arrived (a receive posted now will not block)."""
        return (from_pp_rank, kind) in self._recv_meta

    def recv(self, from_pp_rank: int, kind: str) -> tuple[dist.Work, torch.Tensor]:
        """Post a receive from pipeline rank ``from_pp_rank``; returns the work and the buffer
        (valid after ``work.wait()``). The first receive on a channel waits for its header."""
        key = (from_pp_rank, kind)
        if key not in self._recv_meta:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(header, src=self._global(from_pp_rank, kind), group=self.groups[kind])
            self._recv_meta[key] = self._parse(header)
        shape, dtype = self._recv_meta[key]
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.irecv(buffer, src=self._global(from_pp_rank, kind), group=self.groups[kind]), buffer

    def finish_sends(self) -> None:
        """Wait for every send started so far (end of a step: buffers may then be freed)."""
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()

    def _header(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if len(shape) > _HEADER - 2:
            raise ValueError(f"pipeline tensors have at most {_HEADER - 2} dimensions, got shape {shape}")
        values = [len(shape), *shape] + [0] * (_HEADER - 2 - len(shape)) + [_DTYPES.index(dtype)]
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    @staticmethod
    def _parse(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        values = header.tolist()
        return tuple(values[1 : 1 + values[0]]), _DTYPES[values[-1]]
