"""The gradient-communication overlap timer (``profiling.CommOverlap``) on real futures, with
sleeps standing in for compute, blocking launches and waits. Every bound below holds by
construction (a sleep never returns early; the timer reads the clock between the test's own
readings), so a loaded machine cannot fail them."""

from __future__ import annotations

import time

import torch

from loomtrain.distributed.data_parallel import Pending
from loomtrain.profiling import CommOverlap

GAP_S = 0.03  # one sleep: a stretch of compute, a blocking launch or a wait


def test_hidden_time_is_in_flight_time_before_compute_end_outside_launch_calls():
    """Catches: a completed collective still counted as in flight (polls ignored: the last gap of
    pure compute would count as hidden), a launch call that blocks counted as hidden while an
    earlier collective is in flight, and blocking launches or the final wait left out of the
    exposed time."""
    overlap, first, second = CommOverlap(enabled=True), torch.futures.Future(), torch.futures.Future()
    t0 = time.perf_counter()
    overlap.launched(first, t0)
    time.sleep(GAP_S)  # backward computes while `first` is in flight
    blocked_start = time.perf_counter()
    time.sleep(GAP_S)  # the launch call of `second` blocks (as gloo's reduce-scatter copies its input)
    before_launch = time.perf_counter()
    overlap.launched(second, blocked_start)
    after_launch = time.perf_counter()
    first.set_result(None)
    overlap.poll()
    time.sleep(GAP_S)  # backward computes while `second` is in flight
    second.set_result(None)
    overlap.poll()
    second_seen = time.perf_counter()
    time.sleep(GAP_S)  # backward computes with nothing in flight: neither hidden nor exposed
    compute_end = time.perf_counter()
    overlap.compute_ended()
    time.sleep(GAP_S)  # the rest of finish_gradient_sync
    overlap.synced()
    synced = time.perf_counter()
    step = overlap.pop()
    assert 2 * GAP_S <= step.hidden_s <= (blocked_start - t0) + (second_seen - before_launch)
    assert 2 * GAP_S <= step.exposed_s <= (synced - compute_end) + (after_launch - blocked_start)
    assert step.comm_s == step.hidden_s + step.exposed_s
    assert overlap.pop() is None  # one record per synchronized step


def test_handle_without_completion_counts_in_flight_until_compute_end():
    """Catches: a reduction whose handle cannot report completion (the hierarchical hook's,
    gloo's reduce-scatter) dropped from the figure, or the timer crashing on it; and a timer
    that records on CUDA, where host clocks do not see NCCL's kernels."""
    overlap = CommOverlap(enabled=True)
    start = time.perf_counter()
    overlap.launched(Pending(None, lambda: torch.zeros(1)), start)
    time.sleep(GAP_S)
    overlap.poll()
    overlap.compute_ended()
    compute_end = time.perf_counter()
    overlap.synced()
    assert GAP_S <= overlap.pop().hidden_s <= compute_end - start
    off = CommOverlap(enabled=False)
    off.launched(torch.futures.Future(), time.perf_counter())
    off.compute_ended()
    off.synced()
    assert off.pop() is None
