"""Checks that run before any file is written: in the launcher before any worker starts, and
in the workers once, on rank 0, before any model is built.

The launcher (``loomtrain train``) calls :func:`check_launch` before starting workers, with
cheap checks of the newest checkpoint (manifest and sizes; an explicitly named one with its
checksums too); in the workers, :func:`check_once` runs the same checks once, on rank 0, with
every checkpoint checksum it needs, and gives all ranks the verdict and the checkpoint to
resume from. That covers a plain ``torchrun`` launch too. A ``--resume auto`` start hashes
each checkpoint file once, a ``--resume <dir>`` start twice (launcher and rank 0). All checks
only read.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from loomtrain.checkpoint import find_latest_checkpoint, list_checkpoints, verify_checkpoint
from loomtrain.cluster.throttle import CORE_CAP, parse_speed_changes, place_ranks, throttle_requirements
from loomtrain.config import Config, ConfigError, read_toml
from loomtrain.data import check_data_files
from loomtrain.distributed.parallel_dims import ParallelDims, is_main_process
from loomtrain.hardware import usable_cpus

# Settings a resumed run must share with the run it continues: the checkpoint's tensors and
# the saved tokenizer only fit these.
_RESUME_FIXED = {"model": None, "data": None, "training": ("seq_len",)}
# More threads per CPU than this and every process runs at a fraction of a core's speed.
OVERSUBSCRIBED = 2


def check_launch(cfg: Config, world_size: int, hashes: bool = False) -> Path | None:
    """Everything checkable without a process group, for ``world_size`` processes; returns
    the checkpoint the run will resume from (``None``: a fresh start). ``hashes``: verify the
    checkpoint's checksums (reads every byte) rather than only its manifest and sizes.

    Raises:
        ConfigError: bad world layout, data files, backend, or run-directory state.
    """
    check_world(cfg, world_size)
    if cfg.distributed.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("distributed.backend='nccl' needs CUDA GPUs; none is visible here, use 'gloo' or 'auto'")
    check_rank_devices(cfg, world_size)
    check_data_files(cfg.data)
    return check_run_dir(cfg, hashes)


def check_once(cfg: Config, world_size: int) -> Path | None:
    """:func:`check_launch` with checksums, run on rank 0 only; every rank gets its verdict (a
    collective: one broadcast). Returns the checkpoint to resume from, or ``None``.

    Raises:
        ConfigError: on every rank, what rank 0's checks found.
    """
    verdict: list = [None, None, None]  # error kind, message, checkpoint
    error = None
    if is_main_process():
        try:
            verdict[2] = check_launch(cfg, world_size, hashes=True)
        except Exception as err:  # every rank must hear of it, or the others wait in the broadcast forever
            error, verdict[:2] = err, [type(err).__name__, str(err)]
    dist.broadcast_object_list(verdict, src=0)
    kind, message, checkpoint = verdict
    if kind == "ConfigError":
        raise ConfigError(message)
    if error is not None:
        raise error
    if kind is not None:
        raise RuntimeError(f"rank 0's start-up checks failed with {kind}: {message}")
    return checkpoint


def check_world(cfg: Config, world_size: int) -> None:
    """The parallel degrees and the batch layout fit ``world_size`` processes.

    Raises:
        ConfigError: a world size below 1, degrees that do not divide it, a global batch not
            divisible by dp × micro-batch, or an emulated device with dp > 1.
    """
    if world_size < 1:
        raise ConfigError(f"--nproc={world_size} must be at least 1")
    dp = ParallelDims.from_config(cfg.parallel, world_size).dp
    if cfg.simulate.device is not None and dp > 1:
        raise ConfigError(f"simulate.device={cfg.simulate.device!r} on {world_size} processes gives dp={dp}; "
                          f"emulated runs are pipeline ranks only: set --nproc to {world_size // dp}")  # fmt: skip
    cfg.validate_batch(dp)
    cfg.validate_balance(dp)
    check_simulation(cfg, world_size)


def oversubscription_warning(nproc: int, threads: int, cpus: int) -> str | None:
    """The one-line warning for ``nproc`` processes of ``threads`` threads each on ``cpus`` CPUs
    when they exceed :data:`OVERSUBSCRIBED` threads per CPU, else None. Not an error: such a job
    runs, but each process gets a fraction of a core, so it is slow and its tokens/s and MFU
    describe the sharing, not the hardware."""
    if nproc * threads <= OVERSUBSCRIBED * cpus:
        return None
    return (
        f"warning: --nproc={nproc} processes × {threads} thread(s) (OMP_NUM_THREADS) on {cpus} CPU(s) this "
        f"process may use (os.cpu_count()={os.cpu_count()}): each process gets about {cpus / (nproc * threads):.2f} "
        "of a core, so training is slow and its tokens/s and MFU reflect the sharing; lower --nproc"
    )


def warn_if_oversubscribed(nproc: int) -> None:
    """Print :func:`oversubscription_warning` on stderr, if any, for the workers' threads
    (``OMP_NUM_THREADS``, 1 unless set, as the launcher passes it) and the CPUs this process may
    run on (sched_getaffinity(2), else ``os.cpu_count()``). The launcher calls it once."""
    try:
        threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1").split(",")[0]))
    except ValueError:
        threads = 1
    message = oversubscription_warning(nproc, threads, usable_cpus())
    if message is not None:
        print(message, file=sys.stderr, flush=True)


def check_rank_devices(cfg: Config, world_size: int) -> None:
    """``run.rank_devices`` has one entry per rank, its CUDA ranks have a GPU, and a mixed job
    does not ask for NCCL.

    Raises:
        ConfigError: the wrong number of entries, CUDA without a GPU, or NCCL with CPU ranks.
    """
    devices = cfg.run.rank_devices
    if not devices:
        return
    if len(devices) != world_size:
        raise ConfigError(f"run.rank_devices has {len(devices)} entries for {world_size} ranks; give one per rank")
    if "cuda" in devices and not torch.cuda.is_available():
        raise ConfigError("run.rank_devices names 'cuda' but no CUDA device is visible; use 'cpu' for those ranks")
    if "cpu" in devices and cfg.distributed.backend == "nccl":
        raise ConfigError("run.rank_devices has CPU ranks, which NCCL cannot join; use distributed.backend='gloo'")


def check_simulation(cfg: Config, world_size: int) -> None:
    """``simulate.rank_speed`` and ``simulate.speed_change`` fit ``world_size`` ranks and this machine.

    Raises:
        ConfigError: a speed list of the wrong length, speeds that cannot be packed onto this
            machine's cores, malformed or out-of-range speed changes, or no
            root / CPU controller.
    """
    sim = cfg.simulate
    if not sim.rank_speed:
        if sim.speed_change:
            raise ConfigError("simulate.speed_change needs simulate.rank_speed (one speed per rank); set both")
        return
    if len(sim.rank_speed) != world_size:
        raise ConfigError(
            f"simulate.rank_speed has {len(sim.rank_speed)} entries for {world_size} ranks; give one per rank"
        )
    try:
        cores = place_ranks(sim.rank_speed)
        changes = parse_speed_changes(sim.speed_change)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    speeds = list(sim.rank_speed)
    for change in sorted(changes, key=lambda c: c.step):
        if change.rank >= world_size:
            raise ConfigError(f"simulate.speed_change names rank {change.rank}; ranks are 0..{world_size - 1}")
        speeds[change.rank] = change.speed
        load = sum(s for s, core in zip(speeds, cores, strict=True) if core == cores[change.rank])
        if load > CORE_CAP:
            raise ConfigError(
                f"simulate.speed_change {change.step}:{change.rank}:{change.speed} puts {load:.2f} of a core on core "
                f"{cores[change.rank]} (at most {CORE_CAP}); lower the speed"
            )
    reason = throttle_requirements()
    if reason:
        raise ConfigError(reason)


def _only_launcher_logs(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds nothing but the launcher's ``logs/agent_<i>.log`` files."""
    entries = list(run_dir.iterdir())
    logs = run_dir / "logs"
    return entries == [logs] and logs.is_dir() and all(p.name.startswith("agent_") for p in logs.iterdir())


def check_run_dir(cfg: Config, hashes: bool = True) -> Path | None:
    """Refuse what would lose or corrupt an existing run; returns the checkpoint to resume
    from (``None``: a fresh start). ``hashes``: as for :func:`check_launch`; a checkpoint that
    fails them is skipped, with a warning, in favour of the previous one.

    Raises:
        ConfigError: checkpoints present without ``--resume``/``--overwrite``; both given;
            ``--overwrite`` on a directory loomtrain did not write; an explicit checkpoint
            that is incomplete; a resume whose model, data or sequence length differ from
            the run's saved config.
    """
    run_dir, resume = cfg.run_dir, cfg.checkpoint.resume
    if cfg.run.overwrite and resume != "never":
        raise ConfigError("--overwrite and --resume contradict each other; pass one of them")
    if cfg.run.overwrite:
        # A launch whose workers failed before writing config.toml leaves only the launcher's logs/.
        written = run_dir.exists() and ((run_dir / "config.toml").is_file() or _only_launcher_logs(run_dir))
        if run_dir.exists() and not written:
            raise ConfigError(
                f"run.overwrite: {run_dir} exists but is not a loomtrain run (no config.toml); not deleting it"
            )
        return None
    if resume == "never":
        # Any checkpoint with a manifest marks a run that a fresh start would mix with: no checksums needed.
        latest = find_latest_checkpoint(run_dir / "checkpoints", warn=False, hashes=False)
        if latest is not None:
            raise ConfigError(
                f"run directory {run_dir} already has checkpoint {latest.name}; pass --resume auto to "
                "continue it, --overwrite to start over, or --run.name=<new name>"
            )
        _refuse_to_truncate_history(run_dir)
        return None
    if resume == "auto":
        latest = find_latest_checkpoint(run_dir / "checkpoints", warn=hashes, hashes=hashes)
        if latest is None:
            _refuse_if_all_damaged(run_dir / "checkpoints", hashes)
            return None
    else:
        latest = Path(resume)
        # Always with checksums: a damaged checkpoint the user named is refused before any worker starts.
        problem = verify_checkpoint(latest)
        if problem:
            raise ConfigError(f"checkpoint.resume={resume!r} is not a complete checkpoint: {problem}")
    # <run>/checkpoints/step_N: the config beside the checkpoint, also when it is another run's.
    _check_same_run(cfg, latest.parent.parent / "config.toml")
    return latest


def _refuse_if_all_damaged(directory: Path, hashes: bool) -> None:
    """A run whose every checkpoint is damaged must not restart from step 0: that start would
    truncate its logs and retention would delete the damaged checkpoints (issue #23, item 3)."""
    damaged = {path.name: verify_checkpoint(path, hashes) for path in list_checkpoints(directory)}
    if damaged:
        listed = "; ".join(f"{name}: {problem}" for name, problem in damaged.items())
        raise ConfigError(
            f"every checkpoint in {directory} is damaged ({listed}); nothing was changed. Start over explicitly "
            "with --overwrite (deletes the run directory), or keep it and train under --run.name=<new name>"
        )


def _refuse_to_truncate_history(run_dir: Path) -> None:
    """A fresh start in a run directory with logged steps (a run that ended before its first
    checkpoint) would truncate ``metrics.jsonl``: only ``--overwrite`` may discard history."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        raise ConfigError(
            f"run directory {run_dir} holds a previous run's metrics.jsonl but no checkpoint to resume; pass "
            "--overwrite to start over (deletes it), or --run.name=<new name> to keep it"
        )


def _check_same_run(cfg: Config, saved_file: Path) -> None:
    if not saved_file.exists():
        return
    fix = "restore it from a copy, or start over with --overwrite (which deletes the run's checkpoints)"
    saved = read_toml(saved_file, "the resumed run's config.toml", fix)
    current = cfg.model_dump()
    for section, keys in _RESUME_FIXED.items():
        for key in keys or current[section]:
            old, new = saved.get(section, {}).get(key), current[section][key]
            if old != new and not (old is None and new in (None, [])):
                raise ConfigError(
                    f"{section}.{key}={new!r} differs from the run being resumed ({old!r} in {saved_file}); "
                    f"drop the override or start a new run with --run.name"
                )
