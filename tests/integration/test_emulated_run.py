"""``loomtrain train --simulate.device``: a pipeline run on emulated H100s, 2 processes, through
``run_emulated`` and ``loomtrain report``. Each test names the bug it would catch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loomtrain.cli import main
from loomtrain.config import load_config
from loomtrain.distributed.spawn import spawn
from loomtrain.report import bubble_summary, load_timeline

# Llama 3 70B's shape (80 layers of width 8,192), 256 tokens per micro-batch: 40 layers per stage
# take about 20 ms per forward on an emulated H100, long against this host's time per action.
RUN = [
    "--model.preset=llama3-70b", "--model.max_seq_len=256", "--training.seq_len=256", "--training.steps=3",
    "--training.global_batch_size=4", "--training.micro_batch_size=1", "--training.log_interval=1",
    "--parallel.pipeline_parallel_degree=2", "--simulate.device=h100", "--metrics.progress_bar=false",
    "--metrics.tensorboard=false", "--checkpoint.enabled=false",
]  # fmt: skip


def run(overrides: list[str]) -> dict:
    from loomtrain.emulated_run import run_emulated

    return run_emulated(load_config(None, overrides))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("emulated")
    spawn(run, 2, [*RUN, f"--run.out_dir={out}", "--run.name=emulated"], timeout_s=180)
    return out / "emulated"


def test_every_output_of_an_emulated_run_says_so(run_dir, capsys):
    """Catches an emulated run whose figures could pass for measurements: a metrics record, the
    summary, the timeline or the report's bubble line without the emulated device's name."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["emulated_device"] == "h100" for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["emulated"]["device"] == "h100" and "not measured" in summary["emulated"]["note"]
    assert summary["peak_flops"]["note"] == "emulated h100"
    assert load_timeline(run_dir)["emulated"]["device"] == "h100"
    assert bubble_summary(load_timeline(run_dir)).startswith("EMULATED h100 (cost model, not hardware): step 3")
    assert main(["report", str(run_dir)]) == 0
    assert "EMULATED h100" in capsys.readouterr().out


def test_emulated_steps_follow_the_cost_model(run_dir):
    """Catches an emulated run whose step time is not the schedule's replay with the cost model's
    action times (a stage waiting the wrong time, the last stage's head left out, the host stalling
    the devices), within the 5 % past which the run warns that the host could not keep up."""
    emulated = json.loads((run_dir / "summary.json").read_text())["emulated"]
    assert emulated["device_step_s"] == pytest.approx(emulated["replayed_step_s"], rel=0.05)
    assert emulated["replayed_step_s"] > 0.1  # 4 micro-batches of 20 ms stages: the model, not the host
