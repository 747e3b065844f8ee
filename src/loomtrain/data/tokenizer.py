"""Tokenizers: character level (nanoGPT's ``shakespeare_char``) and byte-level BPE.

Both are built from the training text, saved into the run directory and loaded back by
``loomtrain generate`` and on resume, so ids never change meaning within a run.
"""

from __future__ import annotations

import itertools
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from loomtrain.config import ConfigError

_META_FILE = "tokenizer_meta.json"
_CHARS_FILE = "chars.json"
_BPE_FILE = "tokenizer.json"


class Tokenizer(ABC):
    """Text ↔ token ids. ``kind`` is ``"char"`` or ``"bpe"``; ids lie in ``[0, vocab_size)``."""

    kind: str
    vocab_size: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (a list or a 1-D tensor)."""

    @abstractmethod
    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D int64 tensor, fast enough for a whole corpus."""

    def save(self, directory: Path) -> None:
        """Write the tokenizer into ``directory`` (created if missing); ``load_tokenizer`` reads it back."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / _META_FILE).write_text(json.dumps({"kind": self.kind, "vocab_size": self.vocab_size}))
        self._save_vocab(directory)

    @abstractmethod
    def _save_vocab(self, directory: Path) -> None: ...


def _as_list(ids: Sequence[int]) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


class CharTokenizer(Tokenizer):
    """One id per character: id = position of the character in the sorted vocabulary.

    As nanoGPT's ``data/shakespeare_char/prepare.py``: the vocabulary is the set of characters
    of the text it is built from, so other text may hold characters it cannot encode.
    """

    kind = "char"

    def __init__(self, chars: Sequence[str]):
        self.chars = list(chars)
        self.vocab_size = len(self.chars)
        self._ids = {c: i for i, c in enumerate(self.chars)}
        # Lookup table indexed by Unicode code point, -1 for characters outside the vocabulary;
        # the last entry is always -1 so that larger code points can be clipped onto it.
        self._table = np.full(max(map(ord, self.chars), default=0) + 2, -1, dtype=np.int64)
        self._table[[ord(c) for c in self.chars]] = np.arange(self.vocab_size)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary = sorted distinct characters of ``text``."""
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        """Raises ValueError naming the first character not in the vocabulary."""
        return self.encode_tensor(text).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in _as_list(ids))

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Vectorised over code points (about 0.1 s for 5 MB). Raises ValueError on an unknown character."""
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = self._table[np.minimum(points, len(self._table) - 1)]
        unknown = np.flatnonzero(ids < 0)
        if unknown.size:
            char = text[unknown[0]]
            raise ValueError(f"character {char!r} (U+{ord(char):04X}) is not in the tokenizer's vocabulary")
        return torch.from_numpy(ids)

    def _save_vocab(self, directory: Path) -> None:
        (directory / _CHARS_FILE).write_text(json.dumps(self.chars, ensure_ascii=False), encoding="utf-8")


def _line_chunks(text: str, size: int = 1 << 16) -> list[str]:
    """``text`` cut after the first newline past every ``size`` characters.

    Chunks let ``encode_batch`` spread a corpus over threads; cutting only at line ends keeps
    the pieces BPE sees nearly identical to those of the whole text (a whitespace run that
    spans a cut may split differently).
    """
    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size) + 1 or len(text)
        chunks.append(text[start:end])
        start = end
    return chunks


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) from the HuggingFace ``tokenizers`` library.

    The 256 byte symbols are always in the vocabulary, so every text encodes. Text is encoded
    in chunks of whole lines (``encode_batch``, parallel in Rust); ``encode`` uses the same
    chunks so both give identical ids.
    """

    kind = "bpe"

    def __init__(self, hf_tokenizer: HFTokenizer):
        self.hf = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size()

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Learn ``vocab_size - 256`` merges (fewer if the text runs out of pairs) from ``text``."""
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(text.splitlines(keepends=True), trainer)
        return cls(hf)

    def encode(self, text: str) -> list[int]:
        return self.encode_tensor(text).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(_as_list(ids))

    def encode_tensor(self, text: str) -> torch.Tensor:
        encodings = self.hf.encode_batch(_line_chunks(text), add_special_tokens=False)
        ids = itertools.chain.from_iterable(e.ids for e in encodings)
        return torch.tensor(np.fromiter(ids, dtype=np.int64))

    def _save_vocab(self, directory: Path) -> None:
        self.hf.save(str(directory / _BPE_FILE))


def build_tokenizer(kind: str, text: str, bpe_vocab_size: int) -> Tokenizer:
    """A new tokenizer of ``kind`` (``data.tokenizer``) built from ``text``.

    Raises:
        ConfigError: unknown ``kind``.
    """
    if kind == "char":
        return CharTokenizer.from_text(text)
    if kind == "bpe":
        return BPETokenizer.train(text, bpe_vocab_size)
    raise ConfigError(f"data.tokenizer={kind!r} is not a tokenizer; use 'char' or 'bpe'")


def load_tokenizer(directory: Path) -> Tokenizer:
    """Read back what ``Tokenizer.save`` wrote into ``directory``.

    Raises:
        FileNotFoundError: ``directory`` holds no saved tokenizer.
        ValueError: the saved kind is unknown.
    """
    directory = Path(directory)
    meta_path = directory / _META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"no tokenizer saved in '{directory}' ({_META_FILE} is missing)")
    kind = json.loads(meta_path.read_text())["kind"]
    if kind == "char":
        return CharTokenizer(json.loads((directory / _CHARS_FILE).read_text(encoding="utf-8")))
    if kind == "bpe":
        return BPETokenizer(HFTokenizer.from_file(str(directory / _BPE_FILE)))
    raise ValueError(f"'{meta_path}' names tokenizer kind {kind!r}; expected 'char' or 'bpe'")


def encode_to_tensor(tok: Tokenizer, text: str) -> torch.Tensor:
    """``text`` as token ids: 1-D int64 tensor of shape ``[n_tokens]``."""
    return tok.encode_tensor(text)
