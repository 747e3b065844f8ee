"""The server's state between rounds, checkpointed atomically after each round so a run resumes.

One ``server_state.npz`` in the run directory, replaced by rename (:func:`loomtrain.cache.write_atomic`):
a server killed at any moment leaves the previous round's file or the new one, never a torn one.
Under ``--secure ckks`` it holds the encrypted aggregate only (the server never has the model).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loomtrain.cache import write_atomic

STATE_FILE = "server_state.npz"


@dataclass
class ServerState:
    """``round``: last completed round (0: none). ``params``: global model float32 ``[N]`` (plaintext
    modes; ``None`` until the first aggregate). ``ciphertexts``: the encrypted aggregate (``ckks``).
    ``adam_m``/``adam_v``: FedAdam's moments ``[N]``. ``settings``: the run's settings as a dict, to
    refuse resuming with different ones. ``privacy``: ``[noise multiplier, sample rate]`` of each
    completed round under ``--dp-noise`` (``federated/privacy.py``), so a resumed run's ε counts the
    rounds before the crash."""

    round: int = 0
    params: np.ndarray | None = None
    ciphertexts: list[bytes] | None = None
    adam_m: np.ndarray | None = None
    adam_v: np.ndarray | None = None
    settings: dict = field(default_factory=dict)
    privacy: list[list[float]] = field(default_factory=list)


def save_state(directory: Path, state: ServerState) -> Path:
    """Write ``state`` to ``directory/server_state.npz`` atomically; returns the path.

    Raises:
        OSError: the directory cannot be written.
    """
    arrays = {k: getattr(state, k) for k in ("params", "adam_m", "adam_v") if getattr(state, k) is not None}
    if state.ciphertexts is not None:
        arrays["ct_blob"] = np.frombuffer(b"".join(state.ciphertexts), np.uint8)
        arrays["ct_sizes"] = np.array([len(c) for c in state.ciphertexts], np.int64)
    meta = {"round": state.round, "settings": state.settings, "privacy": state.privacy}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path = Path(directory) / STATE_FILE
    write_atomic(path, buf.getvalue())
    return path


def load_state(directory: Path) -> ServerState | None:
    """The state saved in ``directory``, or ``None`` when there is none.

    Raises:
        ValueError: the file exists but is not a server state (names the file).
    """
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            data = {k: z[k] for k in z.files}
        meta = json.loads(data.pop("meta").tobytes())
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"{path} is not a loomtrain federated server state ({e}); delete it or use another --out"
        ) from None
    cts = None
    if "ct_blob" in data:
        blob, offsets = data["ct_blob"].tobytes(), np.cumsum(np.r_[0, data["ct_sizes"]])
        cts = [blob[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    return ServerState(meta["round"], data.get("params"), cts, data.get("adam_m"), data.get("adam_v"),
                       meta["settings"], meta.get("privacy", []))  # fmt: skip
