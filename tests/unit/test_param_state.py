"""The checkpoint's ``param_state`` (state shaped like the parameters beside the optimizer's,
e.g. DiLoCo's outer momentum) read back in one process: present, absent from a checkpoint
written before it existed, and not taken for model weights."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from loomtrain.checkpoint import PARAM_STATE, load_model_weights, load_param_state


def test_param_state_loads_where_saved_and_is_absent_from_older_checkpoints(tmp_path):
    """Catches: a checkpoint without the entry (written before param_state existed) failing to
    load or loading something instead of reporting none (``None``: the momentum restarts), the
    entry not read back as saved, and its keys taken for model keys by the model-shape check
    (every new checkpoint refused as "does not fit this model")."""
    model = nn.Linear(3, 2, bias=False)
    momentum = {"weight": torch.arange(6.0).view(2, 3)}
    with warnings.catch_warnings():
        # DCP warns that no process group exists; one process is the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "old")
        new = {"model": model.state_dict(), PARAM_STATE: {"outer_momentum": momentum}}
        dcp.save(new, checkpoint_id=tmp_path / "new")
        assert load_param_state(tmp_path / "old", "outer_momentum", {"weight": torch.zeros(2, 3)}) is None
        loaded = load_param_state(tmp_path / "new", "outer_momentum", {"weight": torch.zeros(2, 3)})
        load_model_weights(tmp_path / "new", nn.Linear(3, 2, bias=False))
    assert torch.equal(loaded["weight"], momentum["weight"])
