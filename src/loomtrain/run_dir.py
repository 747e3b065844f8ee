"""The run directory: the one place that deletes it for ``run.overwrite`` and that lays it out."""

from __future__ import annotations

import shutil

from loomtrain.config import Config
from loomtrain.data import Tokenizer


def apply_overwrite(cfg: Config) -> None:
    """Delete the run directory if ``run.overwrite`` asks for it (``preflight.check_run_dir``
    has checked that it is a loomtrain run)."""
    if cfg.run.overwrite and cfg.run_dir.exists():
        shutil.rmtree(cfg.run_dir)


def prepare_run_dir(cfg: Config, config_toml: str, tokenizer: Tokenizer) -> None:
    """Rank 0, after every check passed: apply ``run.overwrite``, create the directory, write
    the config as the user gave it (``config.toml``) and the tokenizer (``tokenizer/``)."""
    apply_overwrite(cfg)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.toml").write_text(config_toml)
    tokenizer.save(cfg.run_dir / "tokenizer")
