"""Each ``summary.json`` figure combines the ranks' values as its ``reductions`` entry and
docs/metrics.md say: times and memory are the largest rank's, throughput is the whole job's over
the slowest rank's seconds. Checked on 2 pipeline ranks whose stages differ in size (1 and 3
layers) and whose clocks are set apart (rank 1 twice as slow), so rank 0's own figures differ
from the reduced ones.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from loomtrain.config import load_config
from loomtrain.distributed.data_parallel import AllReduceHook
from loomtrain.distributed.parallel_dims import ParallelDims
from loomtrain.hardware import Peak
from loomtrain.metrics import SUMMARY_REDUCTIONS, MetricsProcessor, Throughput, TrainingMetrics
from loomtrain.models import Transformer
from loomtrain.models.parallelize import parallelize_llama
from tests.distributed.checks import check_result, run_checks, spawn_once

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
KINDS = {"same", "global", "max", "mean"}
TOKENS_PER_DEVICE = 1000


def summary_on_two_stages() -> dict:
    """Rank r: stage r of a 4-layer model split 1 | 3, one timed step of 1 + r seconds, wall 10 + r s."""
    cfg = load_config(None, ["--model.n_layers=4", "--model.dim=32", "--model.n_heads=2", "--model.vocab_size=64",
                             "--parallel.pipeline_parallel_degree=2", "--parallel.stage_boundaries=[1]"])  # fmt: skip
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    pm = parallelize_llama(model, dims, cfg, AllReduceHook())
    pm.sync.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    rank = dist.get_rank()
    speed = Throughput(TOKENS_PER_DEVICE, 1e6, Peak(1e12, "datasheet"), 2)
    speed.add(1.0 + rank)
    metrics = TrainingMetrics(MetricsProcessor(Path("."), 1, enabled=False), pm, speed, torch.device("cpu"))
    own = pm.sync.state_bytes()
    summary = metrics.summary(wall_s=10.0 + rank, final_step=1, loss=1.0)
    return {"summary": summary, "own_param_bytes": own["param_bytes"]}


def checks() -> dict:
    return run_checks({"summary": summary_on_two_stages})


def test_summary_takes_the_slowest_and_fullest_rank():
    """Catches: ``wall_s``, tokens/s and model-state bytes taken from rank 0 alone (a faster rank
    with a smaller pipeline stage), which understates time and memory and overstates throughput."""
    results = spawn_once(checks, 2, timeout_s=120)
    ranks = [check_result(results, "summary", r) for r in (0, 1)]
    summary = ranks[0]["summary"]
    assert summary == ranks[1]["summary"]  # every rank reports the same figures
    assert summary["wall_s"] == 11.0
    assert summary["tokens_per_s"] == TOKENS_PER_DEVICE * 2 / 2.0
    assert ranks[1]["own_param_bytes"] > ranks[0]["own_param_bytes"]
    assert summary["param_bytes"] == ranks[1]["own_param_bytes"]


def test_every_summary_figure_names_its_reduction():
    """Catches: a summary figure written without saying how it combines the ranks (it would read
    as ``"rank 0"``), or a reduction kind outside the documented four."""
    summary = check_result(spawn_once(checks, 2, timeout_s=120), "summary")["summary"]
    reductions = summary.pop("reductions")
    assert reductions.keys() == summary.keys()
    assert set(reductions.values()) <= KINDS, reductions


def documented_reductions() -> dict[str, str]:
    """``{key: reduction}`` from the summary.json table of docs/metrics.md (first two columns)."""
    section = DOCS.read_text().split("## summary.json", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    return {key: kind.strip() for keys, kind in rows for key in re.findall(r"`([a-z_]+)`", keys)}


def test_docs_state_each_summary_reduction():
    """Catches: docs/metrics.md describing a summary figure's reduction other than the code's, or
    leaving a figure out."""
    assert documented_reductions() == SUMMARY_REDUCTIONS
