"""The rendezvous timeouts a shrinking job runs with (issue #23, item 8): a lost node must leave
the rendezvous within seconds, not torchrun's defaults (15 s of missed heartbeats, then 30 s of
last call). The agents' command lines go through torchrun's own parser into torch's dynamic
rendezvous handler, and the settings are read back from the handler."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.run import config_from_args, parse_args

from loomtrain.launch import ElasticSpec, agent_commands

# Longest a dead node may hold up a shrink's rendezvous: heartbeats missed, then the last call.
MAX_DROP_S = 10


def handler_settings(argv: list[str]):
    """The settings torch's rendezvous handler takes from one agent's command line."""
    config, _, _ = config_from_args(parse_args(argv[argv.index("torch.distributed.run") + 1 :]))
    params = RendezvousParameters(config.rdzv_backend, config.rdzv_endpoint, config.run_id, config.min_nodes,
                                  config.max_nodes, **config.rdzv_configs)  # fmt: skip
    backend = C10dRendezvousBackend(HashStore(), config.run_id)
    return create_handler(HashStore(), backend, params)._settings


@pytest.mark.parametrize("rank", [0, 2])
def test_a_lost_node_leaves_a_shrinking_rendezvous_within_seconds(rank):
    """Catches: an elastic job that may shrink (``--min-nproc`` < ``--nproc``) launched with
    torchrun's default keep-alive and last call, which make every shrink wait about 45 s for
    the rendezvous alone (issue #23, item 8: 51 s against 9 s for a same-size restart)."""
    cmds = agent_commands(3, ["--run.name=x"], ElasticSpec(min_nodes=2, max_nodes=3, max_restarts=3), "job")
    settings = handler_settings(cmds[rank])
    dead_after = settings.keep_alive_interval * settings.keep_alive_max_attempt
    assert dead_after + settings.timeout.last_call <= timedelta(seconds=MAX_DROP_S), settings
    assert settings.keep_alive_interval >= timedelta(seconds=1)  # a loaded agent still beats in time
