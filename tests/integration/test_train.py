"""The whole training loop on 2 gloo processes: resume is exact, a corrupted checkpoint is
skipped for the previous one, the run directory holds what it promises, generation samples
the trained weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loomtrain.checkpoint import load_model_weights
from loomtrain.config import Config, load_config
from loomtrain.data import Tokenizer, load_tokenizer
from loomtrain.distributed.spawn import spawn
from loomtrain.generation import generate_from_run
from loomtrain.models import Transformer, generate

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


# Each fixture is one run, so a crash in the resumed run fails only the tests that use it.
@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, dict]:
    """(run directory, summary) of an uninterrupted 20-step run."""
    out = tmp_path_factory.mktemp("runs")
    return out / "whole", train_2proc(out, "whole", "--training.steps=20")


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> tuple[Path, dict]:
    """(run directory, summary of the second half) of the same run stopped after step 10 and
    resumed to 20. The first half saves asynchronously, the second synchronously: the
    exact-resume check covers both ways of writing a checkpoint."""
    out = tmp_path_factory.mktemp("runs")
    train_2proc(out, "split", "--training.steps=10", "--checkpoint.async_save=true")
    return out / "split", train_2proc(out, "split", "--training.steps=20", "--checkpoint.resume=auto")


def test_resumed_run_has_identical_losses(whole, split):
    """Catches: optimizer moments, LR step, data position or RNG lost across a restart, or an
    asynchronous save sealed before its writes finished."""
    (whole_dir, _), (split_dir, resumed) = whole, split
    assert resumed["start_step"] == 10
    assert losses(split_dir) == losses(whole_dir)
    assert len(losses(whole_dir)) == 20


def test_corrupt_newest_checkpoint_falls_back_to_previous(whole, split):
    """Catches: loading a truncated checkpoint, or giving up instead of using an older one."""
    (whole_dir, _), (split_dir, _) = whole, split
    ckpts = split_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000015", "step_00000020"]
    shard = next((ckpts / "step_00000020").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-16])
    (ckpts / "step_00000025.partial").mkdir()
    again = train_2proc(split_dir.parent, "split", "--training.steps=20", "--checkpoint.resume=auto")
    assert again["resumed_from"].endswith("step_00000015")
    assert losses(split_dir) == losses(whole_dir)


def test_run_directory_contents(whole):
    """Catches: a missing artifact that the README promises."""
    run, _ = whole
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


# After 20 steps the model is still close to uniform: at 40 tokens and temperature 0.8 a sampler
# that ignored the temperature (used 1) gave the same text; 100 tokens at 0.5 tell them apart.
PROMPT, NEW_TOKENS, TEMPERATURE, TOP_K, SEED = "ROMEO:", 100, 0.5, 50, 0


def reference_sample(cfg: Config, tokenizer: Tokenizer, checkpoint: Path | None) -> str:
    """The sample decoded here, in one process, from the run's initial weights (its seed's
    untrained model) or, given ``checkpoint``, from that checkpoint's weights."""
    torch.manual_seed(cfg.run.seed)
    model = Transformer(cfg.model)
    if checkpoint is not None:
        load_model_weights(checkpoint, model)
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    gen = torch.Generator().manual_seed(SEED)
    ids = generate(model, prompt, NEW_TOKENS, cfg.model.max_seq_len, TEMPERATURE, TOP_K, gen)
    return tokenizer.decode(ids[0].tolist())


def test_generate_from_run_samples_the_newest_trained_weights(whole):
    """Catches: ``loomtrain generate`` (``generate_from_run``) sampling from weights it never
    loaded, from an older checkpoint than the newest (step 15 of 20 here), or with another seed,
    temperature, top-k or context than it was given; and a run whose checkpoint holds untrained
    weights. Its text must equal a reference decoded here from the newest checkpoint and
    differ from what the run's untrained model samples with the same seed."""
    run, _ = whole
    cfg = load_config(run / "config.toml")
    tokenizer = load_tokenizer(run / "tokenizer")
    cfg.model.vocab_size = tokenizer.vocab_size
    text = generate_from_run(run, PROMPT, NEW_TOKENS, TEMPERATURE, TOP_K, seed=SEED)
    assert text.startswith(PROMPT) and len(text) == len(PROMPT) + NEW_TOKENS  # one character per token
    assert text == reference_sample(cfg, tokenizer, run / "checkpoints" / "step_00000020")
    assert text != reference_sample(cfg, tokenizer, None)
