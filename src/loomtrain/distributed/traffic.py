"""Bytes a rank puts on the wire, per mesh axis: measured where each collective is issued.

The counts use the bandwidth-optimal algorithms' per-rank send volumes for a group of ``n``
ranks and a message of ``M`` bytes (Patarasuk & Yuan 2009 for the ring all-reduce; Thakur,
Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH", 2005):

- all-reduce: ``2·(n−1)/n · M``
- all-gather (``M`` = the full output): ``(n−1)/n · M``, i.e. each rank sends its part to n−1 ranks
- reduce-scatter (``M`` = the full input): ``(n−1)/n · M``
- all-to-all (``M`` = this rank's input): the bytes addressed to other ranks, exactly;
- point-to-point (pipeline activations and gradients): the bytes sent, exactly.

A group of one rank sends nothing.
"""

from __future__ import annotations

from collections import defaultdict

# Gradient reduction over the data-parallel ranks (with sp) is counted under this name.
GRADIENT_AXIS = "dp"
# The part of GRADIENT_AXIS's bytes that crossed hosts (hierarchical and auto comm hooks): a
# sub-count of "dp", not more bytes, so it must not be added to the other axes.
INTER_HOST_AXIS = "dp_inter_host"


def all_reduce_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return 2 * (n - 1) * nbytes // n


def all_gather_bytes(output_nbytes: int, n: int) -> int:
    """Bytes one rank sends in an all-gather whose gathered output has ``output_nbytes``."""
    return (n - 1) * output_nbytes // n


def reduce_scatter_bytes(input_nbytes: int, n: int) -> int:
    """Bytes one rank sends in a reduce-scatter of an input of ``input_nbytes``."""
    return (n - 1) * input_nbytes // n


class Traffic:
    """Per-axis byte counters (``axis`` is a mesh axis name: ``"dp"``, ``"tp"``, ``"sp"``, ...)."""

    def __init__(self) -> None:
        self.bytes: defaultdict[str, int] = defaultdict(int)

    def all_reduce(self, axis: str, nbytes: int, n: int) -> None:
        self.bytes[axis] += all_reduce_bytes(nbytes, n)

    def all_gather(self, axis: str, output_nbytes: int, n: int) -> None:
        self.bytes[axis] += all_gather_bytes(output_nbytes, n)

    def reduce_scatter(self, axis: str, input_nbytes: int, n: int) -> None:
        self.bytes[axis] += reduce_scatter_bytes(input_nbytes, n)

    def all_to_all(self, axis: str, sent_to_others_nbytes: int) -> None:
        self.bytes[axis] += sent_to_others_nbytes

    def point_to_point(self, axis: str, nbytes: int) -> None:
        self.bytes[axis] += nbytes

    def snapshot(self) -> dict[str, int]:
        """The totals so far, as a plain dict."""
        return dict(self.bytes)
