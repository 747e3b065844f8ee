"""The emulated device clock (``pipeline/emulated.py``) and the checks of ``--simulate.device``, in one process."""

from __future__ import annotations

import time

import pytest
import torch

from loomtrain.config import ConfigError, load_config
from loomtrain.distributed.pipeline.emulated import DEVICES, DeviceClock, read_stamp
from loomtrain.preflight import check_world

PIPELINE = ["--parallel.pipeline_parallel_degree=2", "--model.n_layers=4"]


def test_a_stamp_travels_in_a_fresh_tensor_of_the_same_shape():
    """Catches a stamp written into the tensor the stage keeps (a send still in flight, or the
    activation saved for backward, would change under it) or lost to a dtype conversion (bf16
    cannot hold a time in seconds)."""
    clock = DeviceClock(DEVICES["h100"])
    out = torch.zeros(2, 16, 8, dtype=torch.bfloat16)
    sent = clock.stamp(out, 1_780_000_000.123456)
    assert sent.shape == out.shape and sent.dtype == out.dtype and sent.data_ptr() != out.data_ptr()
    assert read_stamp(sent) == 1_780_000_000.123456
    assert torch.count_nonzero(out) == 0
    with pytest.raises(ValueError, match="at least 8 bytes"):
        clock.stamp(torch.zeros(2, dtype=torch.bfloat16), 1.0)


def test_work_starts_when_the_device_is_free_and_its_input_ready_and_the_host_runs_ahead():
    """Catches a device clock that starts work before its input was computed (the receiver would
    overlap the sender), that queues an action's pieces in parallel instead of one after the
    other, or whose host waits for each piece to end (then the host's own time per action would
    add to every action, the gap this clock exists to remove)."""
    clock, ready = DeviceClock(DEVICES["h100"]), time.time() + 0.05
    clock.begin(clock.stamp(torch.zeros(4), ready))
    clock.run(0.03)
    clock.run(0.02)
    returned = time.time()
    start, end = clock.end()
    assert start == ready and end == pytest.approx(ready + 0.05)
    assert ready <= returned < end  # blocked until the device started the work, not until it ended
    clock.synchronize()
    assert time.time() >= end


def test_simulate_device_refuses_what_it_cannot_emulate_naming_the_field():
    """Catches an emulated run that starts with a setting it would silently ignore (tensor
    parallelism, ZeRO, throttling, several dp ranks) or without a pipeline to emulate."""
    with pytest.raises(ConfigError, match="emulates pipeline stages; set parallel.pipeline_parallel_degree"):
        load_config(None, ["--simulate.device=h100"])
    with pytest.raises(ConfigError, match="simulate.device='v100' is unknown; choose one of a100, h100"):
        load_config(None, ["--simulate.device=v100", *PIPELINE])
    with pytest.raises(ConfigError, match="set data_parallel.zero_stage=0"):
        load_config(None, ["--simulate.device=h100", "--data_parallel.zero_stage=2", *PIPELINE])
    cfg = load_config(None, ["--simulate.device=a100", *PIPELINE])
    check_world(cfg, 2)
    with pytest.raises(ConfigError, match="gives dp=2; emulated runs are pipeline ranks only: set --nproc to 2"):
        check_world(cfg, 4)
