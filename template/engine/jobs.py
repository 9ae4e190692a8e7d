"""The job's processes and the cluster's queue: a child that ends with its parent, a SLURM job put back in the queue.

Light on purpose (no torch, no Lightning): the sweep's driver uses it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
_REQUEUE_TIMEOUT = 60  # seconds; scontrol answers in well under a second on a healthy controller


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
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=_REQUEUE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job} failed ({err})"
    return None if done.returncode == 0 else f"scontrol requeue {job} failed: {done.stderr.strip()}"
