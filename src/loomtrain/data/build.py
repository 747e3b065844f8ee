"""A run's data: the corpus read, the tokenizer agreed by all ranks, the token streams."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from loomtrain.config import Config, ConfigError
from loomtrain.data.corpus import load_corpus
from loomtrain.data.tokenizer import Tokenizer, build_tokenizer, encode_to_tensor, load_tokenizer
from loomtrain.distributed.parallel_dims import is_main_process


@dataclass
class Data:
    """Token streams (1-D int64) and the tokenizer of a run."""

    tokenizer: Tokenizer
    train: torch.Tensor
    val: torch.Tensor


def build_data(cfg: Config, saved_tokenizer: Path | None) -> Data:
    """Read the corpus and tokenize it. Rank 0 builds the tokenizer (or, when resuming, loads
    the one saved beside the checkpoint, ``saved_tokenizer``) and broadcasts it, so all ranks
    agree on the vocabulary (a collective).

    Raises:
        ConfigError: a split too short for one sample of ``training.seq_len`` tokens.
    """
    train_text, val_text = load_corpus(cfg.data)
    box: list[Tokenizer | None] = [None]
    if is_main_process():
        if saved_tokenizer is not None:
            box[0] = load_tokenizer(saved_tokenizer)
        else:
            box[0] = build_tokenizer(cfg.data.tokenizer, train_text + val_text, cfg.data.bpe_vocab_size)
    dist.broadcast_object_list(box, src=0)
    tok = box[0]
    data = Data(tok, encode_to_tensor(tok, train_text), encode_to_tensor(tok, val_text))
    for split, tokens in (("training", data.train), ("validation", data.val)):
        if len(tokens) < cfg.training.seq_len + 1:
            raise ConfigError(
                f"the {split} text has {len(tokens)} tokens, fewer than one sample of training.seq_len+1="
                f"{cfg.training.seq_len + 1}; use more text or lower training.seq_len"
            )
    return data


def resolve_vocab(cfg: Config, vocab_size: int) -> None:
    """Take the model's vocabulary size from the tokenizer unless the config fixes a larger one.

    Raises:
        ConfigError: ``model.vocab_size`` smaller than the tokenizer's.
    """
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = vocab_size
    elif cfg.model.vocab_size < vocab_size:
        source, fix = "", "set model.vocab_size=0 to take the tokenizer's size"
        if cfg.model.init_from:
            source = f" (from model.init_from={cfg.model.init_from!r})"
            fix = "start from a checkpoint whose vocabulary holds the tokenizer's ids"
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size}{source} is smaller than the tokenizer's {vocab_size}; {fix}"
        )
