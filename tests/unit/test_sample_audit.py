"""The sample audit (``<run>/samples/rank_*.jsonl``) across a shrink: a 3-rank attempt trains
past its last checkpoint and dies; the run resumes on 2 ranks from that checkpoint. The audit
must then show every step's planned global batch exactly once (issue #23, item 4)."""

from __future__ import annotations

import torch

from loomtrain.data.loader import DistributedBatchLoader
from loomtrain.metrics import SampleRecorder
from tests.integration.test_elastic import samples_by_step

GLOBAL_BATCH, SEQ_LEN, SEED = 12, 8, 0
TOKENS = torch.arange(4000)


def attempt(run, world: int, start: int, stop: int, position: dict | None) -> dict:
    """Ranks ``0..world-1`` train steps ``start+1..stop`` from ``position``, recording their
    samples as the trainer does (rank 0 is built last, as its clean-up runs at any moment)."""
    loaders = [DistributedBatchLoader(TOKENS, SEQ_LEN, GLOBAL_BATCH, GLOBAL_BATCH // world, r, world, SEED)
               for r in range(world)]  # fmt: skip
    recorders = [SampleRecorder(run, r, start, True, world) for r in reversed(range(world))][::-1]
    for loader in loaders:
        if position is not None:
            loader.load_state_dict(position)
    saved = None
    for step in range(start + 1, stop + 1):
        for loader, recorder in zip(loaders, recorders, strict=True):
            loader.next_step()
            recorder.record(step, loader.last_sample_ids)
        if step == 10:
            saved = loaders[0].state_dict()
    for recorder in recorders:
        recorder.close()
    return saved


def planned(steps: int) -> dict[int, list[int]]:
    loader = DistributedBatchLoader(TOKENS, SEQ_LEN, GLOBAL_BATCH, GLOBAL_BATCH, 0, 1, SEED)
    plan = {}
    for step in range(1, steps + 1):
        loader.next_step()
        plan[step] = sorted(i for mb in loader.last_sample_ids for i in mb)
    return plan


def test_audit_after_a_shrink_shows_each_planned_sample_once(tmp_path):
    """Catches: records of a rank that no longer exists (rank 2 of the dead 3-rank attempt)
    keeping steps 11-15 that the attempt ran past its checkpoint at step 10, so the audit
    counts those steps' samples twice (issue #23, item 4)."""
    checkpoint = attempt(tmp_path, 3, 0, 15, None)
    attempt(tmp_path, 2, 10, 15, checkpoint)
    assert samples_by_step(tmp_path) == planned(15)
