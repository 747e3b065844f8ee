"""Graceful stop on SIGTERM, agreed by all ranks."""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist


class Preemption:
    """Graceful stop on SIGTERM (a scheduler's preemption notice, or torchrun passing on the
    launcher's SIGTERM): the handler only sets a flag; after each step the ranks agree by a
    one-element all-reduce (MAX), so all stop at the same step and checkpoint together."""

    def __init__(self) -> None:
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank received SIGTERM (a collective over all ranks)."""
        flag = torch.tensor([int(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
