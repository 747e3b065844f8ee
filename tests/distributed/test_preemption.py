"""The ranks' agreement on a SIGTERM (graceful preemption), checked one step late."""

from __future__ import annotations

import torch
import torch.distributed as dist

from loomtrain.distributed.preemption import Preemption
from loomtrain.distributed.spawn import spawn

CALLS, SIGNALLED_BEFORE = 6, 3


def answers_with_rank_1_signalled() -> list[bool]:
    """Each rank's answers to ``agreed`` over ``CALLS`` steps; only rank 1 is signalled, before
    the call of step ``SIGNALLED_BEFORE``."""
    preemption = Preemption()
    answers = []
    for call in range(CALLS):
        if dist.get_rank() == 1 and call == SIGNALLED_BEFORE:
            preemption.requested = True
        answers.append(preemption.agreed(torch.device("cpu")))
    preemption.drain()
    return answers


def test_every_rank_agrees_on_one_ranks_signal_at_the_next_step():
    """Catches: ranks that stop at different steps (a rank leaving the loop while the other
    waits in the next step's collectives: a hang), a flag read before its all-reduce finished
    or from the wrong step, a signal that is lost, and a check that never reports one."""
    want = [call > SIGNALLED_BEFORE for call in range(CALLS)]
    assert spawn(answers_with_rank_1_signalled, 2) == [want, want]
