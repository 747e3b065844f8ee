"""Text sampling from a trained model, in memory or from a run directory's latest checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from loomtrain.checkpoint import find_latest_checkpoint, load_model_weights
from loomtrain.config import Config, ConfigError, load_config
from loomtrain.data import load_tokenizer
from loomtrain.models import Transformer, generate


def sample(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float,
    top_k: int | None,
    seed: int,
) -> str:
    """Prompt plus ``max_new_tokens`` sampled tokens, decoded; reproducible for ``seed``.

    Raises:
        ConfigError: the prompt holds a character the tokenizer does not know.
    """
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:
        raise ConfigError(f"prompt cannot be encoded: {e}") from None
    device = next(model.parameters()).device
    prompt_ids = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = generate(model, prompt_ids, max_new_tokens, max_seq_len, temperature, top_k, gen)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())


def print_run_end(cfg: Config, model: torch.nn.Module, tokenizer, summary: dict) -> None:
    """What ``loomtrain train`` prints when a run ends: a sample of ``sample.max_new_tokens``
    tokens from ``model`` (none if 0) and one line of the summary's figures. With
    ``log.format = "json"`` stdout stays one JSON object per line: the summary as a ``done``
    object, the sample on stderr."""
    s, as_json = cfg.sample, cfg.log.format == "json"
    if s.max_new_tokens > 0:
        text = sample(model, tokenizer, s.prompt, s.max_new_tokens, cfg.model.max_seq_len, s.temperature, s.top_k,
                      cfg.run.seed)  # fmt: skip
        print(f"\n--- sample ({s.max_new_tokens} tokens) ---\n{text}\n---", file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps({"event": "done", **summary, "run_dir": str(cfg.run_dir)}), flush=True)
        return
    print(
        f"done: step {summary['final_step']}, val loss {summary['val_loss']:.4f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {summary['mfu']:.2%}, wall {summary['wall_s']:.1f} s; "
        f"run directory {cfg.run_dir}"
    )


def generate_from_run(
    run_dir: str | Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int
) -> str:
    """Load ``<run_dir>``'s config, tokenizer and newest complete checkpoint, then sample.

    Raises:
        ConfigError: not a run directory, or it has no complete checkpoint.
    """
    run = Path(run_dir)
    if not (run / "config.toml").is_file():
        raise ConfigError(f"--run={str(run)!r} is not a run directory (no config.toml); train one first")
    cfg = load_config(run / "config.toml")
    tokenizer = load_tokenizer(run / "tokenizer")
    cfg.model.vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    ckpt = find_latest_checkpoint(run / "checkpoints")
    if ckpt is None:
        raise ConfigError(f"--run={str(run)!r} has no complete checkpoint in {run / 'checkpoints'}")
    try:
        tokenizer.encode(prompt)
    except ValueError as e:
        raise ConfigError(f"--prompt cannot be encoded: {e}") from None
    model = Transformer(cfg.model)
    load_model_weights(ckpt, model)
    return sample(model, tokenizer, prompt, max_new_tokens, cfg.model.max_seq_len, temperature, top_k, seed)
