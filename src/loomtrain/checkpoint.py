"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, verified, retained.

Layout under ``<run>/checkpoints/``::

    step_00000500/            a complete checkpoint
        .metadata, __0_0.distcp, ...   DCP files (model, optimizer, step, data position, param_state)
        rank_00000.pt, ...             per-rank state that is not replicated (RNG, TrainState.rank_state)
        manifest.json                  step, world size, size and SHA-256 of every file; written last
    step_00001000.partial/    being written, or left by a crash: never loaded

A checkpoint is written into ``*.partial``; only when every rank has finished does rank 0
write the manifest and rename the directory, an atomic step on POSIX file systems. Loading
checks the manifest's sizes and checksums, so a truncated or corrupted checkpoint is skipped
(with a warning) in favour of the previous one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from loomtrain.distributed.parallel_dims import is_main_process

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
_LAYOUT_DEFAULTS = {"pp": 1, "dp_replicate": 1}
# The DCP key of TrainState.param_state.
PARAM_STATE = "param_state"


@dataclass
class TrainState:
    """What a resumed run needs besides model and optimizer: the optimizer step count, the
    data loader position (a plain dict of ints) and the gradient synchronizer's state
    (``GradientSync.state_dict()``): its ``"shared"`` part (JSON-able, the same on every rank,
    e.g. the fp16 loss scaler) is saved with the step, its ``"per_rank"`` part (tensors
    allowed, e.g. a communication hook's error-feedback residuals) beside the RNG in
    ``rank_XXXXX.pt`` and given back only at the same world size and layout (else empty).
    ``balance``: the load balancers' state (JSON-able, the same on every rank), kept in the
    manifest so a resumed run can read its pipeline split before building the model.
    ``param_state``: state shaped like the parameters beside the optimizer's, by entry then
    parameter name (``{"outer_momentum": {name: tensor}}``), each tensor shaped like what this
    rank holds of its parameter (a DTensor placed like it where the parameter is one): DCP
    writes it sharded like the model, so it reshards to any layout. Only saved:
    :func:`load_param_state` reads an entry back."""

    step: int
    loader: dict[str, Any]
    sync: dict[str, dict[str, Any]] = field(default_factory=lambda: {"shared": {}, "per_rank": {}})
    balance: dict[str, Any] = field(default_factory=dict)
    param_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rank_file(rank: int | None = None) -> str:
    """A rank's own file in a checkpoint (this rank's by default): RNG and per-rank synchronizer state."""
    return f"rank_{dist.get_rank() if rank is None else rank:05d}.pt"


def read_rank_state(path: Path, rank: int) -> dict[str, Any]:
    """The ``rank_state`` that ``rank`` saved in checkpoint ``path``, whatever this run's world
    size or layout (:meth:`CheckpointManager.load` restores only this rank's own, and only at the
    same layout); empty if its file is missing (a disk only that rank sees)."""
    file = path / _rank_file(rank)
    return torch.load(file, weights_only=True).get("rank_state", {}) if file.is_file() else {}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint: ``step``, ``world_size``, ``layout``, ``time``, ``files``."""
    return json.loads((path / MANIFEST).read_text())


def verify_checkpoint(path: Path, hashes: bool = True) -> str | None:
    """Why ``path`` is not a complete checkpoint, or ``None`` if it is.

    Checks that ``manifest.json`` exists and that every file it lists has its recorded size
    and (with ``hashes``; reading every byte) SHA-256.
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return "manifest is not valid JSON"
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"file {name} is missing"
        if f.stat().st_size != meta["bytes"]:
            return f"file {name} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if hashes and _sha256(f) != meta["sha256"]:
            return f"file {name} does not match its SHA-256 checksum"
    return None


def list_checkpoints(directory: Path) -> list[Path]:
    """Every ``step_NNNNNNNN`` directory in ``directory`` (complete or not), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _STEP_DIR.match(p.name))


def find_latest_checkpoint(directory: Path, warn: bool = True, hashes: bool = True) -> Path | None:
    """The newest complete checkpoint in ``directory``, or ``None``.

    Incomplete or corrupted ones (see :func:`verify_checkpoint`; ``hashes``: check checksums
    too) are skipped, with a warning if ``warn``.
    """
    for path in reversed(list_checkpoints(directory)):
        problem = verify_checkpoint(path, hashes)
        if problem is None:
            return path
        if warn:
            log.warning("skipping checkpoint %s: %s; falling back to an older one", path, problem)
    return None


class StateDictSharding(Protocol):
    """Views plain per-rank shards in state dicts as DTensors and back (see
    ``ParallelModel.wrap_state_dicts`` for tensor parallelism)."""

    def wrap_state_dicts(self, model_sd: dict, optim_sd: dict) -> None: ...

    def unwrap_state_dicts(self, model_sd: dict, optim_sd: dict) -> None: ...


class CheckpointManager:
    """Saves and loads training state with DCP. All ranks call :meth:`save` and :meth:`load`.

    Args:
        directory: ``<run>/checkpoints``; shared by all ranks (a shared file system across nodes).
        keep_last: complete checkpoints kept; older ones are deleted after a successful save.
        async_save: write in the background (see :meth:`save`).
        layout: the parallel layout (degrees, ZeRO stage), recorded in each manifest.
    """

    def __init__(self, directory: Path, keep_last: int, async_save: bool = False, layout: dict | None = None):
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.layout = layout or {}
        self._pending: tuple | None = None
        self.last_saved_step: int | None = None
        # An asynchronous save finishes its collectives on a background thread; a group of its
        # own keeps them from interleaving with training's collectives on the default group.
        self._async_group = dist.new_group(backend="gloo") if async_save else None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainState,
        sharding: StateDictSharding | None = None,
    ) -> Path:
        """Write checkpoint ``step_<step>`` atomically; returns its final path.

        ``sharding`` turns plain local shards (tensor parallelism) into DTensors, so DCP
        writes full tensors that load at any degree.

        With ``async_save`` the tensors are staged to host memory and written in the
        background (``dcp.async_save``); the checkpoint becomes complete (manifest, rename) at
        the next :meth:`save` or :meth:`finalize`, never before every rank has written.
        """
        self.finalize()
        self.last_saved_step = step
        final = self.directory / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".partial")
        if is_main_process():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if sharding is not None:
            sharding.wrap_state_dicts(model_sd, optim_sd)
            for entry in state.param_state.values():
                sharding.wrap_state_dicts(entry, {})
        # The small training state travels as one JSON string: DCP stores a non-tensor leaf
        # whole, whereas a nested dict would need a template with the same keys to load into.
        train = json.dumps({"step": state.step, "loader": state.loader, "extra": state.sync["shared"]})
        app = {"model": model_sd, "optim": optim_sd, "train": train}
        if state.param_state:  # checkpoints without it keep the keys they always had
            app[PARAM_STATE] = state.param_state
        torch.save({"rng": _rng_state(), "rank_state": state.sync["per_rank"]}, tmp / _rank_file())
        if self._async_group is None:
            dcp.save(app, checkpoint_id=tmp)
            self._pending = (None, tmp, final, step, state.balance)
            self.finalize()
        else:
            future = dcp.async_save(app, checkpoint_id=tmp, process_group=self._async_group)
            self._pending = (future, tmp, final, step, state.balance)
        return final

    def finalize(self) -> None:
        """Complete the save in flight, if any: wait for this rank's writes, then (once every
        rank is done) rank 0 writes the manifest, renames the directory and prunes old ones."""
        if self._pending is None:
            return
        future, tmp, final, step, balance = self._pending
        self._pending = None
        if future is not None:
            future.result()
        dist.barrier()
        if is_main_process():
            self._seal(tmp, final, step, dist.get_world_size(), balance)
            self._prune()
        dist.barrier()

    def _seal(self, tmp: Path, final: Path, step: int, world_size: int, balance: dict[str, Any]) -> None:
        files = {
            f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(tmp.iterdir()) if f.is_file()
        }
        manifest = {"step": step, "world_size": world_size, "layout": self.layout, "time": time.time(), "files": files,
                    "balance": balance}  # fmt: skip
        with (tmp / MANIFEST).open("w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.directory)

    def _prune(self) -> None:
        for old in list_checkpoints(self.directory)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sharding: StateDictSharding | None = None,
    ) -> TrainState:
        """Load ``path`` into ``model`` and ``optimizer`` in place (resharding as DCP does);
        restore this rank's RNG and ``rank_state`` if the checkpoint was written at the same
        world size and layout (else a warning). ``sharding``: as for :meth:`save`."""
        train = json.loads(_load_states(path, model, optimizer, sharding))
        sync = {"shared": train.get("extra", {}), "per_rank": self._load_rank_state(path)}
        balance = read_manifest(path).get("balance", {})
        return TrainState(step=int(train["step"]), loader=train["loader"], sync=sync, balance=balance)

    def _load_rank_state(self, path: Path) -> dict[str, Any]:
        """This rank's RNG (restored here) and ``rank_state``, if the checkpoint was written at
        the same world size and layout; else empty, with a warning."""
        rng_file = path / _rank_file()
        manifest = read_manifest(path)
        # Rank r's own state means the same thing only if rank r has the same place in the same layout.
        # Older checkpoints lack the degrees added since (pipeline, HSDP): they were 1.
        saved_layout = {**_LAYOUT_DEFAULTS, **manifest.get("layout", {})}
        same_layout = manifest["world_size"] == dist.get_world_size() and saved_layout == {
            **_LAYOUT_DEFAULTS,
            **self.layout,
        }
        if same_layout and rng_file.is_file():
            saved = torch.load(rng_file, weights_only=True)
            # Checkpoints written before per-rank state existed hold the bare RNG state.
            _set_rng_state(saved.get("rng", saved))
            return saved.get("rank_state", {})
        if not same_layout and is_main_process():
            log.warning(
                "checkpoint %s was written by %d ranks with layout %s, this run has %d with %s: per-rank state "
                "(RNG, error-feedback residuals) starts afresh",
                path, manifest["world_size"], manifest.get("layout"), dist.get_world_size(), self.layout,
            )  # fmt: skip
        return {}


def _load_states(path: Path, model, optimizer, sharding: StateDictSharding | None) -> str:
    """Load the model's parameters and the optimizer's state from ``path`` in place; returns
    the saved training state (JSON).

    The optimizer's hyperparameters (``param_groups``) are this run's, not the checkpoint's:
    they come from the config (the learning rate from the schedule at every step), and under
    pipeline parallelism each rank's groups list other parameters while DCP keeps one copy.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Pipeline ranks hold different parameters: together they must hold what was saved.
    wanted: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(wanted, sorted(model_sd))
    _check_same_keys(path, {key for keys in wanted for key in keys})
    if sharding is not None:
        sharding.wrap_state_dicts(model_sd, optim_sd)
    app = {"model": model_sd, "optim": {"state": optim_sd["state"]}, "train": ""}
    dcp.load(app, checkpoint_id=path)
    app["optim"]["param_groups"] = optim_sd["param_groups"]
    if sharding is not None:
        sharding.unwrap_state_dicts(app["model"], app["optim"])
    set_state_dict(model, optimizer, model_state_dict=app["model"], optim_state_dict=app["optim"])
    return app["train"]


def load_param_state(path: Path, entry: str, template: dict[str, torch.Tensor],
                     sharding: StateDictSharding | None = None) -> dict[str, torch.Tensor] | None:  # fmt: skip
    """``entry`` of the ``param_state`` saved in checkpoint ``path`` (:class:`TrainState`),
    resharded to this run's layout: loaded into ``template`` (``{parameter name: tensor shaped
    like what this rank holds of it}``, as it was saved; ``sharding`` as for
    :meth:`CheckpointManager.save`), which is returned. ``None``, loading nothing, where the
    checkpoint has no such entry (written before it existed, or without it). A collective
    (every rank must call it, with the names of the parameters it holds).

    Raises:
        RuntimeError: (DCP) the entry lacks a name in ``template`` (another model).
    """
    prefix = f"{PARAM_STATE}.{entry}."
    if not any(k.startswith(prefix) for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata):
        return None
    if sharding is not None:
        sharding.wrap_state_dicts(template, {})
    app = {PARAM_STATE: {entry: template}}
    dcp.load(app, checkpoint_id=path)
    if sharding is not None:
        sharding.unwrap_state_dicts(app[PARAM_STATE][entry], {})
    return app[PARAM_STATE][entry]


def _check_same_keys(path: Path, wanted: set[str]) -> None:
    """DCP loads whatever subset of keys is asked for; a model of another shape would load
    silently half-filled, so the saved parameter names and ``wanted`` (those of the whole
    model, over all ranks) must match exactly."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    missing, extra = sorted(wanted - saved), sorted(saved - wanted)
    if missing or extra:
        raise ValueError(
            f"checkpoint {path} does not fit this model: missing {missing[:3]}, unexpected {extra[:3]} "
            "(was it written with other model settings?)"
        )


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """Load only the model's weights from a checkpoint, in one process (no process group),
    e.g. for generation."""
    state = {"model": model.state_dict()}
    _check_same_keys(path, set(state["model"]))
    with warnings.catch_warnings():
        # DCP warns that no process group exists; loading in one process is the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
