"""The planner prices loomtrain's logging collectives as the trainer makes them (``planner/time.py``'s
``logging_seconds``): 2-process CPU runs, counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from loomtrain.config import load_config
from loomtrain.distributed.spawn import spawn
from loomtrain.planner.time import LOG_WORLD_ALL_REDUCES

TINY = [
    "--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.max_seq_len=16",
    "--training.seq_len=16", "--training.global_batch_size=4", "--training.micro_batch_size=2",
    "--training.steps=3", "--training.log_interval=1", "--training.eval_interval=1000",
    "--training.eval_batches=1", "--sample.max_new_tokens=0", "--metrics.progress_bar=false",
    "--checkpoint.enabled=false", "--run.device=cpu",
]  # fmt: skip
# Collectives a logged step could make besides all-reduces: none is priced, so none may appear.
OTHERS = ("all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "reduce", "gather", "barrier")


def logged_collectives(overrides: list[str]) -> list[list]:
    """Per logged step, the collectives this rank made inside ``_log_step``: an all-reduce as the
    size of its group, any other collective as its name."""
    from loomtrain import trainer

    steps, inside, log_step = [], [False], trainer.Trainer._log_step
    originals = {name: getattr(dist, name) for name in ("all_reduce", *OTHERS)}

    def counting(name):
        def call(*args, **kwargs):
            if inside[0]:
                group = kwargs.get("group", args[2] if name == "all_reduce" and len(args) > 2 else None)
                steps[-1].append(dist.get_world_size(group) if name == "all_reduce" else name)
            return originals[name](*args, **kwargs)

        return call

    def counted_log_step(self, *args, **kwargs):
        steps.append([])
        inside[0] = True
        try:
            return log_step(self, *args, **kwargs)
        finally:
            inside[0] = False

    for name in originals:
        setattr(dist, name, counting(name))
    trainer.Trainer._log_step = counted_log_step
    try:
        trainer.train(load_config(None, overrides))
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        trainer.Trainer._log_step = log_step
    return steps


@pytest.mark.parametrize("tp, grad_ranks", [(1, 2), (2, 1)])
def test_a_logged_step_makes_the_all_reduces_the_planner_prices(tmp_path: Path, tp: int, grad_ranks: int):
    """Catches: a collective added to (or dropped from) the trainer's logged step, or moved to another
    group, without the planner's count following: at 4 ranks on 2 cores each costs about 6 ms a
    logged step, so the own runs, logging every step, were priced 25 ms a step fast at dp 4 without
    them. dp 2: every all-reduce over both ranks; tp 2: the loss's mean over a gradient group of
    one. On a CPU the overlap timer adds one over all ranks. The last step also evaluates (its own
    collectives), so the steps before it are counted."""
    out = [*TINY, f"--run.out_dir={tmp_path}", "--run.name=logging", f"--parallel.tensor_parallel_degree={tp}"]
    expected = sorted([2] * (LOG_WORLD_ALL_REDUCES + 1) + [grad_ranks])
    for steps in spawn(logged_collectives, 2, out, timeout_s=180):
        assert [sorted(step) for step in steps[:-1]] == [expected] * 2
