"""Stopping on a scheduler's signal: a checkpoint at the next step boundary, a SLURM requeue, a non-zero exit."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from template.engine.internals import cluster_environment, stop_as_on_sigterm

INTERRUPTED = "interrupted.ckpt"
_REQUEUE_TIMEOUT = 60  # seconds; scontrol answers in well under a second on a healthy controller


class Preemption(Callback):
    """On SIGTERM, or SLURM's requeue signal (SIGUSR1), write a checkpoint at the next step boundary and stop.

    Lightning's own SLURM handler saves inside the signal handler: in the middle of a step (not an exact resume)
    and, under DDP, with collectives that the other ranks are not in (a hang). Here the handler only records the
    signal; all ranks agree on it after the same step, write ``interrupted.ckpt`` together, rank zero asks SLURM to
    requeue the job (``scontrol requeue``, when Lightning's ``SLURMEnvironment.auto_requeue`` is on), and Lightning
    stops the loop as it does for SIGTERM.
    """

    def __init__(self) -> None:
        self._received: int | None = None
        self._stopping: tuple[int, str, bool] | None = None
        self.signalled_at: float | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning's signal connector has installed its handlers (at the start of the run), so that these
        # replace them; Lightning restores the original handlers when the run ends.
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._record)
        signal.signal(_requeue_signal(trainer), self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self._received is None:
            self._received, self.signalled_at = signum, time.monotonic()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self._stopping is not None:
            return
        signum = self._agreed_signal(trainer)
        if signum is None:
            return
        path = str(Path(_checkpoint_dir(trainer)) / INTERRUPTED)
        trainer.save_checkpoint(path)
        # Lightning's loggers buffer; what was logged up to this step reaches the disk now.
        for logger in trainer.loggers:
            logger.save()
        requeued = signum == _requeue_signal(trainer) and _auto_requeue(trainer) and _requeue(trainer)
        self._stopping = (signum, path, requeued)
        then = "the job is requeued and continues by itself" if requeued else "run the same command to continue"
        after = f" {time.monotonic() - self.signalled_at:.2f} s after the signal" if self.signalled_at else ""
        rank_zero_info(f"Stopping on {signal.Signals(signum).name}: checkpoint {path} written{after}; {then}")
        # Lightning ends the loop after this step's logging, as it does on its own SIGTERM handling.
        stop_as_on_sigterm(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._stopping is not None and isinstance(exception, SIGTERMException):
            # Lightning's SIGTERMException exits 0; a run stopped before its end exits 128 + the signal, as if killed.
            exception.code = 128 + self._stopping[0]

    def _agreed_signal(self, trainer: Trainer) -> int | None:
        """The signal any rank received, the same on every rank after the same step."""
        if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
            return self._received
        code = torch.tensor([self._received or 0], device=trainer.strategy.root_device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        return int(code.item()) or None


def _checkpoint_dir(trainer: Trainer) -> str:
    callback = trainer.checkpoint_callback
    if callback is not None and getattr(callback, "dirpath", None):
        return str(callback.dirpath)
    return os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints")


def _requeue_signal(trainer: Trainer) -> int:
    environment = cluster_environment(trainer)
    if isinstance(environment, SLURMEnvironment) and environment.requeue_signal is not None:
        return environment.requeue_signal
    return signal.SIGUSR1


def _auto_requeue(trainer: Trainer) -> bool:
    environment = cluster_environment(trainer)
    return isinstance(environment, SLURMEnvironment) and environment.auto_requeue


def _requeue(trainer: Trainer) -> bool:
    """Rank zero asks SLURM to put this job back in the queue; True when it accepted."""
    if not trainer.is_global_zero:
        return True
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=_REQUEUE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as err:
        rank_zero_warn(f"scontrol requeue {job} failed ({err}); resubmit the same sbatch command to continue")
        return False
    if done.returncode != 0:
        rank_zero_warn(f"scontrol requeue {job} failed: {done.stderr.strip()}; resubmit the same command to continue")
    return done.returncode == 0
