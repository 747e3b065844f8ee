"""Starting a job under SLURM: one torchrun agent per allocated node, built from ``SLURM_*``.

``examples/slurm/train.sbatch`` runs ``srun python -m loomtrain.slurm -- train --config ...``
with one task per node; each task turns its node's SLURM variables into the torchrun command
line that a user would type on that machine (``launch.torchrun_argv``: c10d rendezvous on the
first node of the allocation) and replaces itself with it. Untested on a real SLURM cluster:
the tests check the command line built from the variables.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

from loomtrain.config import ConfigError
from loomtrain.launch import torchrun_argv

RDZV_PORT = 29500
_RANGE = re.compile(r"\[([^\]]*)\]")


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a SLURM node list, in order: ``"gpu[01-03,7],login1"`` →
    ``["gpu01", "gpu02", "gpu03", "gpu7", "login1"]`` (zero padding kept, as
    ``scontrol show hostnames`` prints them).

    Raises:
        ConfigError: a range like ``[3-1]`` or an unclosed bracket.
    """
    names: list[str] = []
    for item in _split_top_level(nodelist):
        names.extend(_expand_item(item))
    return names


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"SLURM_JOB_NODELIST={text!r} has an unclosed '['")
    items.append(text[start:])
    return [x for x in items if x]


def _expand_item(item: str) -> list[str]:
    match = _RANGE.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    return [head + n + rest for n in _expand_range(match.group(1), item) for rest in _expand_item(tail)]


def _expand_range(spec: str, item: str) -> list[str]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        hi = hi or lo
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ConfigError(f"SLURM node list item {item!r}: cannot read the range {part!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _required(env: Mapping[str, str], name: str) -> str:
    if name not in env:
        raise ConfigError(f"{name} is not set: run this inside a SLURM allocation (sbatch/srun), one task per node")
    return env[name]


def slurm_torchrun_argv(env: Mapping[str, str], loomtrain_argv: list[str]) -> list[str]:
    """The torchrun command line for this node of the allocation, followed by
    ``-m loomtrain.cli <loomtrain_argv>``.

    Read: ``SLURM_JOB_NODELIST`` (first node serves the rendezvous on ``MASTER_PORT`` or 29500),
    ``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_JOB_ID`` (rendezvous id), processes per node
    from ``LOOMTRAIN_NPROC_PER_NODE``, else ``SLURM_GPUS_ON_NODE``, else 1; ``--elastic`` in
    ``loomtrain_argv`` gives ``--max-restarts=3``, ``--nnodes=1:N`` and workers that resume
    from the newest checkpoint.

    Raises:
        ConfigError: a variable missing (not inside an allocation) or unreadable.
    """
    nodes = expand_nodelist(_required(env, "SLURM_JOB_NODELIST"))
    nnodes, node_id = int(_required(env, "SLURM_NNODES")), int(_required(env, "SLURM_NODEID"))
    if len(nodes) != nnodes:
        raise ConfigError(f"SLURM_JOB_NODELIST names {len(nodes)} nodes but SLURM_NNODES={nnodes}")
    nproc = int(env.get("LOOMTRAIN_NPROC_PER_NODE") or env.get("SLURM_GPUS_ON_NODE") or 1)
    elastic = "--elastic" in loomtrain_argv
    worker = [a for a in loomtrain_argv if a != "--elastic"]
    if elastic:
        # Every attempt, the first included, resumes from the newest complete checkpoint.
        worker.append("--checkpoint.resume=auto")
    endpoint = f"{nodes[0]}:{env.get('MASTER_PORT', RDZV_PORT)}"
    agent = torchrun_argv(f"1:{nnodes}" if elastic else str(nnodes), nproc, endpoint,
                          f"loomtrain-{_required(env, 'SLURM_JOB_ID')}", 3 if elastic else 0,
                          node_rank=node_id)  # fmt: skip
    return [*agent, "-m", "loomtrain.cli", *worker]


def main(argv: list[str] | None = None) -> int:
    """``python -m loomtrain.slurm -- train --config ...``: exec this node's torchrun agent."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:
        argv = argv[1:]
    try:
        cmd = slurm_torchrun_argv(os.environ, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.execv(cmd[0], cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
