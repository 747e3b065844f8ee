"""Run a function on N local processes with a process group: the one helper for tests and benchmarks.

Each process gets a free TCP port on loopback, the gloo backend, one torch thread and a
collective timeout; the parent waits with a deadline and kills every process if it passes,
so a hang fails the caller instead of freezing CI.

The processes are forked from a fork server that has imported torch once
(:data:`FORKSERVER_PRELOAD`), not started afresh: a fresh interpreter spends 4-5 s of CPU importing
torch and its distributed packages, which on 2 cores made up a third to a half of a distributed test's time
(``tests/distributed/test_zero.py`` 46 s with fresh interpreters, 27 s forked). Each process takes
the caller's environment as it is at the call, as a fresh interpreter would, not the server's.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server (the heaviest of a worker's imports). Only torch's packages, no
# loomtrain module: what these read from the environment at import (TORCH_LOGS, for one) keeps the
# value it had when the server started, which loomtrain's callers do not change between calls.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, out_dir: str, timeout_s: float, fn: Callable, args: tuple,
           env: dict[str, str]):  # fmt: skip
    os.environ.clear()  # the fork server's environment is the caller's when the server started, not now
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank_{rank}.pt"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        result = fn(*args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` new processes joined in one gloo process group.

    ``fn`` must be importable (module level). Inside it, ``dist.get_rank()`` tells the rank.

    Returns:
        What each rank's ``fn`` returned, indexed by rank (saved with ``torch.save``, so
        tensors come back intact).
    Raises:
        TimeoutError: not all ranks finished within ``timeout_s`` seconds (all are killed).
        RuntimeError: a rank raised; the message holds that rank's traceback.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    port, env = free_port(), dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="loomtrain-spawn-") as out_dir:
        procs = [
            ctx.Process(target=_child, args=(r, world_size, port, out_dir, timeout_s, fn, args, env), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        _join_all(procs, timeout_s)
        return [_read_result(Path(out_dir) / f"rank_{r}.pt", r) for r in range(world_size)]


def _join_all(procs: list, timeout_s: float) -> None:
    deadline = timeout_s + 30.0  # start-up (importing torch) is not part of the collective timeout
    start = time.monotonic()
    for p in procs:
        p.join(max(0.0, deadline - (time.monotonic() - start)))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    if alive:
        raise TimeoutError(f"{len(alive)} of {len(procs)} ranks still running after {deadline:.0f} s; killed")


def _read_result(path: Path, rank: int) -> Any:
    if not path.exists():
        raise RuntimeError(f"rank {rank} died without a result (killed by a signal or crashed in C++)")
    record = torch.load(path, weights_only=False)
    if not record["ok"]:
        raise RuntimeError(f"rank {rank} failed:\n{record['error']}")
    return record["result"]
