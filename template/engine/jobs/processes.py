"""The job's processes: a child that ends with its parent, a SLURM job put back in the queue (the sweep's driver
uses both too), the process group of a torchrun restart."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import Trainer

from template.engine.internals import process_group_backend, process_group_timeout

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Ask Linux to send this process ``signum`` when its parent exits; elsewhere this is a no-op."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)


def requeue_slurm_job() -> str | None:
    """Ask SLURM to put this job (or this array task) back in the queue: None when it accepted, else why not."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job} failed ({err})"
    return None if done.returncode == 0 else f"scontrol requeue {job} failed: {done.stderr.strip()}"


def join_restarted_group(trainer: Trainer) -> None:
    """After a torchrun restart, create the process group under a key prefix of its own attempt.

    torchrun's workers share the agent's TCPStore, which outlives an attempt: the restarted workers read the dead
    workers' addresses from it and gloo fails to connect ("Connection refused"). Keys under ``attempt_<n>/`` are
    fresh. Lightning keeps a process group that already exists, so this one is used from here on.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    environment = getattr(trainer.strategy, "cluster_environment", None)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not (restart and agent_store and isinstance(environment, TorchElasticEnvironment)) or dist.is_initialized():
        return
    if (backend := process_group_backend(trainer.strategy)) is None:
        return
    timeout = process_group_timeout(trainer.strategy) or timedelta(minutes=30)
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
