"""Deterministic, resumable micro-batches of fixed token windows for data-parallel ranks.

The token stream is cut into non-overlapping windows of ``seq_len + 1`` tokens (input and
target overlap by all but one token). The order in which windows are visited is a function of
the seed and one counter, ``samples_consumed``, shared by all ranks, so the position is global:
a run saved at one world size resumes at another and each optimizer step still sees the same
set of samples.
"""

from __future__ import annotations

import torch
from torch import Tensor

Batch = tuple[Tensor, Tensor]


def _n_windows(tokens: Tensor, seq_len: int) -> int:
    """Number of whole windows: window i is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``.

    Raises:
        ValueError: fewer than ``seq_len + 1`` tokens.
    """
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"{len(tokens)} tokens hold no window of training.seq_len+1={seq_len + 1} tokens; "
            "use more text or lower training.seq_len"
        )
    return n


def _gather(tokens: Tensor, windows: Tensor, seq_len: int) -> Batch:
    """(x, y) for ``windows`` (shape ``[b]``): both int64 ``[b, seq_len]``, y is x shifted left by one."""
    index = windows[:, None] * seq_len + torch.arange(seq_len + 1)
    rows = tokens[index].long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _micro_batch_positions(a: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> range:
    """Positions in the global batch of rank ``dp_rank``'s micro-batch ``a`` (ranks interleave)."""
    start = (a * dp_size + dp_rank) * micro_batch_size
    return range(start, start + micro_batch_size)


class DistributedBatchLoader:
    """One data-parallel rank's micro-batches, step by step.

    Global sample ``k`` is window ``perm_e[k % n_windows]`` with epoch ``e = k // n_windows`` and
    ``perm_e = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed + e))``, so
    a global batch may straddle two epochs. Step ``t`` consumes global samples
    ``[samples_consumed, samples_consumed + global_batch_size)``; with ``A = global_batch_size //
    (dp_size * micro_batch_size)`` accumulation micro-batches, rank ``r``'s micro-batch ``a`` holds
    batch positions ``[(a*dp_size + r)*mb, (a*dp_size + r + 1)*mb)``.

    Args:
        tokens: 1-D tensor of token ids, shape ``[n_tokens]``.
        seq_len: tokens per sample (the model's context for this run).
        global_batch_size: samples per optimizer step, all ranks together.
        micro_batch_size: samples per forward pass on one rank.
        dp_rank, dp_size: this rank's index among the data-parallel ranks, and their number.
        seed: seed of epoch 0's permutation; epoch ``e`` uses ``seed + e``.

    Raises:
        ValueError: ``global_batch_size`` not divisible by ``dp_size * micro_batch_size``, a rank
            out of range, or fewer tokens than one window.
    """

    def __init__(
        self,
        tokens: Tensor,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ):
        per_pass = dp_size * micro_batch_size
        if global_batch_size % per_pass:
            raise ValueError(
                f"training.global_batch_size={global_batch_size} is not divisible by data-parallel size "
                f"{dp_size} × training.micro_batch_size={micro_batch_size}; change one of them"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.n_windows = _n_windows(tokens, seq_len)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.accum_steps = global_batch_size // per_pass
        self.seed = seed
        self.samples_consumed = 0
        self.last_sample_ids: list[list[int]] = []
        self._perms: dict[int, Tensor] = {}

    def _permutation(self, epoch: int) -> Tensor:
        if epoch not in self._perms:
            # Steps only move forward, so earlier epochs are never needed again.
            self._perms = {e: p for e, p in self._perms.items() if e > epoch}
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perms[epoch] = torch.randperm(self.n_windows, generator=generator)
        return self._perms[epoch]

    def _windows(self, samples: Tensor) -> Tensor:
        """Window index of each global sample number in ``samples`` (shape ``[b]``)."""
        epochs = samples // self.n_windows
        windows = torch.empty_like(samples)
        for epoch in epochs.unique().tolist():
            mask = epochs == epoch
            windows[mask] = self._permutation(epoch)[samples[mask] % self.n_windows]
        return windows

    def next_step(self, split: list[int] | None = None) -> list[Batch]:
        """This rank's ``accum_steps`` micro-batches for one optimizer step.

        ``split``: samples of each dp rank this step (a load balancer's; sums to the global
        batch). Rank ``r`` then takes batch positions ``[Σ_{q<r} split[q], Σ_{q<=r} split[q])``
        in ``accum_steps`` micro-batches whose sizes differ by at most one, so every rank runs
        the same number of forward and backward passes. ``None``: the uniform interleaved layout.

        Returns:
            list of (x, y), each int64 ``[b, seq_len]`` (``b = micro_batch_size`` without a split);
            y[i, j] is the token after x[i, j].

        Raises:
            ValueError: a split that does not sum to the global batch or gives this rank fewer
                samples than micro-batches.
        """
        layout = self._uniform_positions() if split is None else self._split_positions(split)
        batches, ids = [], []
        for positions in layout:
            windows = self._windows(torch.tensor([self.samples_consumed + p for p in positions]))
            batches.append(_gather(self.tokens, windows, self.seq_len))
            ids.append(windows.tolist())
        self.samples_consumed += self.global_batch_size
        self.last_sample_ids = ids
        return batches

    def _uniform_positions(self) -> list[range]:
        return [
            _micro_batch_positions(a, self.dp_rank, self.dp_size, self.micro_batch_size)
            for a in range(self.accum_steps)
        ]

    def _split_positions(self, split: list[int]) -> list[range]:
        if len(split) != self.dp_size or sum(split) != self.global_batch_size:
            raise ValueError(
                f"the split {split} must give each of {self.dp_size} dp ranks its samples, "
                f"{self.global_batch_size} in all"
            )
        mine = split[self.dp_rank]
        if mine < self.accum_steps:
            raise ValueError(f"dp rank {self.dp_rank} got {mine} samples for {self.accum_steps} micro-batches")
        start = sum(split[: self.dp_rank])
        base, extra = divmod(mine, self.accum_steps)
        sizes = [base + (a < extra) for a in range(self.accum_steps)]
        edges = [start + sum(sizes[:a]) for a in range(self.accum_steps + 1)]
        return [range(edges[a], edges[a + 1]) for a in range(self.accum_steps)]

    def state_dict(self) -> dict[str, int]:
        """The data position, as plain ints (checkpointed with the model)."""
        return {
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "n_windows": self.n_windows,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position, adopting its seed so the sample order continues unchanged.

        Raises:
            ValueError: the state was saved with another ``seq_len`` or another corpus size.
        """
        for key, mine in (("seq_len", self.seq_len), ("n_windows", self.n_windows)):
            if int(state[key]) != mine:
                raise ValueError(
                    f"data loader state has {key}={state[key]} but this run has {mine}; resume with the "
                    "same training.seq_len and data, or start a new run"
                )
        self.seed = int(state["seed"])
        self.samples_consumed = int(state["samples_consumed"])
        self._perms = {}


def eval_batches(tokens: Tensor, seq_len: int, micro_batch_size: int, n_batches: int) -> list[Batch]:
    """The fixed validation set: the same ``n_batches`` micro-batches at every call and world size.

    ``n_batches * micro_batch_size`` windows are spread evenly over the validation windows
    (cycling through them if there are fewer), ``micro_batch_size`` consecutive ones per
    micro-batch. The set does not depend on the number of ranks, so neither does a loss over it;
    the caller shares the micro-batches out among the data-parallel ranks.

    Returns:
        ``n_batches`` pairs (x, y), each int64 ``[micro_batch_size, seq_len]``.

    Raises:
        ValueError: fewer tokens than one window.
    """
    n_windows = _n_windows(tokens, seq_len)
    total = n_batches * micro_batch_size
    if total <= n_windows:
        spread = torch.arange(total) * n_windows // total
    else:
        spread = torch.arange(total) % n_windows
    return [_gather(tokens, windows, seq_len) for windows in spread.split(micro_batch_size)]
