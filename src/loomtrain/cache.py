"""Files kept between runs on one machine, under ``$LOOMTRAIN_CACHE_DIR`` (default
``~/.cache/loomtrain``): measured peak FLOP/s (``hardware.py``), the parsed Shakespeare corpus
(``data/corpus.py``). Each is an optimisation only: a missing, unreadable or torn file is
rebuilt, and a read-only cache directory costs time, not correctness."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """``$LOOMTRAIN_CACHE_DIR``, or ``~/.cache/loomtrain`` (not created here)."""
    return Path(os.environ.get("LOOMTRAIN_CACHE_DIR") or Path.home() / ".cache" / "loomtrain")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename,
    so processes writing at once, or one killed mid-write, never leave a torn file.

    Raises:
        OSError: the directory cannot be created or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
