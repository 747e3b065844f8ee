"""The planner prices loomtrain's logging collectives as the trainer makes them (``planner/time.py``'s
``logging_seconds``): a 2-process run counted."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from loomtrain.config import load_config
from loomtrain.distributed.spawn import spawn
from loomtrain.planner.time import LOG_ALL_REDUCES

TINY = [
    "--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.max_seq_len=16",
    "--training.seq_len=16", "--training.global_batch_size=4", "--training.micro_batch_size=2",
    "--training.steps=3", "--training.log_interval=1", "--training.eval_interval=1000",
    "--training.eval_batches=1", "--sample.max_new_tokens=0", "--metrics.progress_bar=false",
    "--checkpoint.enabled=false",
]  # fmt: skip


def logged_all_reduces(overrides: list[str]) -> list[int]:
    """All-reduces this rank made inside each logged step's ``_log_step``."""
    from loomtrain import trainer

    counts, inside, all_reduce, log_step = [], [False], dist.all_reduce, trainer.Trainer._log_step

    def counting_all_reduce(*args, **kwargs):
        if inside[0]:
            counts[-1] += 1
        return all_reduce(*args, **kwargs)

    def counted_log_step(self, *args, **kwargs):
        counts.append(0)
        inside[0] = True
        try:
            return log_step(self, *args, **kwargs)
        finally:
            inside[0] = False

    dist.all_reduce, trainer.Trainer._log_step = counting_all_reduce, counted_log_step
    try:
        trainer.train(load_config(None, overrides))
    finally:
        dist.all_reduce, trainer.Trainer._log_step = all_reduce, log_step
    return counts


def test_a_logged_step_makes_the_all_reduces_the_planner_prices(tmp_path: Path):
    """Catches: a collective added to (or dropped from) the trainer's logged step without the planner's
    count following: at 4 ranks on 2 cores each costs about 6 ms a logged step, so the own runs,
    logging every step, were priced 25 ms a step fast at dp 4 without them. The last step also
    evaluates (its own collectives), so the steps before it are counted."""
    out = [*TINY, f"--run.out_dir={tmp_path}", "--run.name=logging"]
    for counts in spawn(logged_all_reduces, 2, out, timeout_s=180):
        assert counts[:-1] == [LOG_ALL_REDUCES + 1] * 2
