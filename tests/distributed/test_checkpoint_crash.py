"""A process killed while a checkpoint is being written never leaves something that loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loomtrain.checkpoint import CheckpointManager, TrainState, find_latest_checkpoint
from loomtrain.distributed.spawn import spawn


def save_then_die_while_sealing(directory: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    manager = CheckpointManager(Path(directory), keep_last=3)
    manager.save(5, model, opt, TrainState(5, {"samples_consumed": 5}))
    if dist.get_rank() == 0:
        # Die after every rank wrote its shard but before the manifest and the rename: the
        # latest moment at which a crash can still leave a half-made checkpoint.
        manager._seal = lambda *a, **k: os._exit(17)
    manager.save(10, model, opt, TrainState(10, {"samples_consumed": 10}))


def test_kill_during_checkpoint_write_leaves_previous_as_latest(tmp_path):
    """Catches: a partial checkpoint taken for a complete one after a crash mid-save."""
    with pytest.raises(RuntimeError):
        spawn(save_then_die_while_sealing, 2, str(tmp_path), timeout_s=30)
    assert (tmp_path / "step_00000010.partial").is_dir()
    assert any((tmp_path / "step_00000010.partial").glob("*.distcp"))
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_00000005"
