"""torchrun restarts: the restarted workers form their process group apart from the failed attempt's."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import Trainer

from template.engine.internals import process_group_backend, process_group_timeout


def join_restarted_group(trainer: Trainer) -> None:
    """After a torchrun restart, create the process group under a key prefix of its own attempt.

    torchrun's workers share the agent's TCPStore, which outlives an attempt: the restarted workers read the dead
    workers' addresses from it and gloo fails to connect ("Connection refused"). Keys under ``attempt_<n>/`` are
    fresh. Lightning keeps a process group that already exists, so this one is used from here on.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    strategy = trainer.strategy
    environment = getattr(strategy, "cluster_environment", None)
    if restart == 0 or not isinstance(environment, TorchElasticEnvironment) or dist.is_initialized():
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    backend = process_group_backend(strategy)
    if backend is None:
        return
    timeout = process_group_timeout(strategy) or timedelta(minutes=30)
    store = dist.TCPStore(
        environment.main_address, environment.main_port, environment.world_size(), is_master=False, timeout=timeout
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"attempt_{restart}", store),
        rank=environment.global_rank(),
        world_size=environment.world_size(),
        timeout=timeout,
    )
