"""The whole training loop on 2 gloo processes: resume is exact, a corrupted checkpoint is
skipped for the previous one, the run directory holds what it promises, generation works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loomtrain.config import load_config
from loomtrain.distributed.spawn import spawn
from loomtrain.generation import generate_from_run

TINY = [
    "--model.n_layers=2", "--model.dim=32", "--model.n_heads=2", "--model.max_seq_len=32",
    "--training.seq_len=32", "--training.global_batch_size=8", "--training.micro_batch_size=2",
    "--training.decay_steps=20", "--training.warmup_steps=4", "--training.log_interval=1",
    "--training.eval_interval=1000", "--training.eval_batches=2", "--sample.max_new_tokens=0",
    "--metrics.progress_bar=false", "--checkpoint.interval=5", "--checkpoint.keep_last=2",
]  # fmt: skip


def run_train(overrides: list[str]) -> dict:
    from loomtrain.trainer import train

    return train(load_config(None, overrides))


def train_2proc(out: Path, name: str, *extra: str) -> dict:
    return spawn(run_train, 2, [*TINY, f"--run.out_dir={out}", f"--run.name={name}", *extra], timeout_s=180)[0]


def losses(run_dir: Path) -> dict[int, float]:
    """step → loss; a step logged twice (redone after a resume) keeps its last value."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    whole = train_2proc(out, "whole", "--training.steps=20")
    # The first half saves asynchronously, the second synchronously: the exact-resume check
    # covers both ways of writing a checkpoint.
    train_2proc(out, "split", "--training.steps=10", "--checkpoint.async_save=true")
    resumed = train_2proc(out, "split", "--training.steps=20", "--checkpoint.resume=auto")
    return out, whole, resumed


def test_resumed_run_has_identical_losses(runs):
    """Catches: optimizer moments, LR step, data position or RNG lost across a restart, or an
    asynchronous save sealed before its writes finished."""
    out, _, resumed = runs
    assert resumed["start_step"] == 10
    assert losses(out / "split") == losses(out / "whole")
    assert len(losses(out / "whole")) == 20


def test_corrupt_newest_checkpoint_falls_back_to_previous(runs):
    """Catches: loading a truncated checkpoint, or giving up instead of using an older one."""
    out, _, _ = runs
    ckpts = out / "split" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000015", "step_00000020"]
    shard = next((ckpts / "step_00000020").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-16])
    (ckpts / "step_00000025.partial").mkdir()
    again = train_2proc(out, "split", "--training.steps=20", "--checkpoint.resume=auto")
    assert again["resumed_from"].endswith("step_00000015")
    assert losses(out / "split") == losses(out / "whole")


def test_run_directory_contents(runs):
    """Catches: a missing artifact that the README promises."""
    out, whole, _ = runs
    run = out / "whole"
    for name in ("config.toml", "metrics.jsonl", "summary.json", "tokenizer"):
        assert (run / name).exists(), name
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((run / "summary.json").read_text())
    for key in ("final_step", "val_loss", "tokens_per_s", "mfu", "wall_s", "world_size", "peak_memory_bytes"):
        assert key in summary, key
    assert summary["final_step"] == 20 and summary["world_size"] == 2
    assert 0 < summary["mfu"] < 1 and summary["peak_memory_bytes"] > 0
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert {"step", "loss", "lr", "tokens_per_s", "mfu"} <= first.keys()
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert "val_loss" in last


def test_generate_from_run_starts_with_prompt(runs):
    out, _, _ = runs
    text = generate_from_run(out / "whole", "ROMEO:", 40, 0.8, 50, seed=0)
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 40
