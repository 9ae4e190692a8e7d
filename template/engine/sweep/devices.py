"""GPUs for trials running at once: each worker slot gets its own, or shares one with ``sweep.trials_per_gpu - 1``
other slots."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from template.engine.errors import ConfigError
from template.engine.strategies.devices import parse_free_request


def gpus_per_trial(trainer: Mapping[str, Any]) -> int | None:
    """How many GPUs one trial's config asks for; None when it runs on the CPU (or asks for all of them)."""
    if str(trainer.get("accelerator", "auto")).lower() == "cpu":
        return None
    devices = trainer.get("devices", "auto")
    if isinstance(devices, list):
        return len(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    request = parse_free_request(devices) if isinstance(devices, str) else None
    if request is not None:
        return request.count
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit() and int(devices) > 0:
        return int(devices)
    return None  # "auto" or -1: every GPU, only for one trial at a time


def slot_gpus(
    trainer: Mapping[str, Any], slots: list[str], per_gpu: int = 1, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for each worker slot: slot ``<host>.<n>`` gets group ``n // per_gpu`` of the visible
    GPUs, so ``per_gpu`` slots in a row share a group (each trial sees it from device 0).

    Slots are numbered over every worker process on the machine (their lock files), so two sweep commands on one
    machine also get different GPUs. On a CPU-only machine, or for a CPU config, nothing is set.
    """
    if isinstance(trainer.get("devices"), list):
        return {}  # the user's own choice of GPUs, the same for every trial
    count = gpus_per_trial(trainer)
    available = torch.cuda.device_count()  # NVML-based: creates no CUDA context
    if count is None or available == 0:
        if available and len(slots) > 1 and str(trainer.get("accelerator", "auto")).lower() != "cpu":
            raise ConfigError(
                f"trainer.devices={trainer.get('devices')!r} takes every GPU, so sweep.workers={len(slots)} trials "
                "cannot run at once; set trainer.devices to a number of GPUs per trial (e.g. 1) or sweep.workers: 1"
            )
        return {}
    hidden = environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in hidden.split(",") if d.strip()] if hidden else [str(i) for i in range(available)]
    groups = {}
    for slot in slots:
        n = int(slot.rsplit(".", 1)[1])
        first = n // per_gpu * count
        group = visible[first : first + count]
        if len(group) < count:
            raise ConfigError(
                f"worker slot {n} needs GPUs {first}..{first + count - 1} ({count} per trial from trainer.devices, "
                f"sweep.trials_per_gpu={per_gpu}) but {len(visible)} are visible; lower sweep.workers or "
                "trainer.devices, or raise sweep.trials_per_gpu"
            )
        groups[slot] = ",".join(group)
    return groups
