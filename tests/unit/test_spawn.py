"""``loomtrain.distributed.spawn``: ranks forked from a fork server behave as fresh interpreters would."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from loomtrain.distributed.spawn import spawn

VARIABLE = "LOOMTRAIN_SPAWN_TEST_VALUE"


def _environment_and_sum() -> tuple[str | None, float]:
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return os.environ.get(VARIABLE), float(total)


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one's own error")


def test_ranks_see_the_callers_environment_at_each_call(monkeypatch):
    """Catches: ranks forked from a fork server that keep the environment the server started with
    (a variable set or removed between two calls, such as GLOO_SOCKET_IFNAME for an emulated host,
    would not reach the second call's ranks), or ranks that are not joined in one process group."""
    monkeypatch.setenv(VARIABLE, "first")
    assert spawn(_environment_and_sum, 2) == [("first", 3.0)] * 2  # the fork server is running from here on
    monkeypatch.setenv(VARIABLE, "second")
    assert spawn(_environment_and_sum, 3) == [("second", 6.0)] * 3
    monkeypatch.delenv(VARIABLE)
    assert spawn(_environment_and_sum, 2) == [(None, 3.0)] * 2


def test_a_ranks_error_reaches_the_caller_with_its_rank_and_traceback():
    """Catches: a forked rank's exception lost (the caller would wait for its deadline or read no
    result) or reported without the rank that raised it."""
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*rank one's own error"):
        spawn(_fail_on_rank_one, 2, timeout_s=30)
