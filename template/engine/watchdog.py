"""Hang watchdog: a rank that hangs ends the whole job within a timeout, and no process of the job outlives it."""

from __future__ import annotations

import atexit
import contextlib
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from template.engine.errors import ConfigError
from template.engine.internals import launched_children, process_group_timeout, set_process_group_timeout
from template.engine.jobs import die_with_parent
from template.engine.mechanism import Mechanism


class HangWatchdog(Callback):
    """Bounds how long a process waits for the others, then takes the whole job down.

    Args:
        timeout: seconds a collective (all-reduce, barrier) may wait for the other processes before the job
            fails. It also bounds how long one rank may work alone while the others wait, e.g. a long
            ``prepare_data`` download on rank 0: raise it for such work.
        grace: seconds the launching process gives its child ranks to exit on their own after an error (not after
            a timeout: then a rank is hung) before killing them.
    """

    announcement = Mechanism(
        "hang watchdog",
        "a rank waiting longer than watchdog.timeout s ends the job; each rank ends its process group at exit",
        "none; raise --watchdog.timeout (Lightning's: 1800)",
    )

    def __init__(self, timeout: float = 600.0, grace: float = 3.0) -> None:
        if timeout <= 0:
            raise ConfigError(f"watchdog.timeout must be a positive number of seconds, got {timeout}; e.g. 600")
        if grace < 0:
            raise ConfigError(f"watchdog.grace must be >= 0 seconds, got {grace}; e.g. 3")
        self.timeout = timeout
        self.grace = grace

    def arm(self, trainer: Trainer) -> None:
        """Give the process group this timeout; called before the trainer starts its processes."""
        strategy = trainer.strategy
        # DDP, FSDP and DeepSpeed keep the process-group timeout here. Lightning's default (30 min) means nobody
        # chose one; an explicit DDPStrategy(timeout=...) is kept.
        if process_group_timeout(strategy) == default_pg_timeout:
            set_process_group_timeout(strategy, timedelta(seconds=self.timeout))

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.local_rank > 0 and launched_children(trainer) is None:
            # A child rank dies with the process that started it (Lightning's launcher, torchrun's agent), even
            # when that one is SIGKILLed and runs no cleanup: a hung child would otherwise live on as an orphan.
            die_with_parent()
        if dist.is_available() and dist.is_initialized():
            end_process_group_at_exit()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """The launcher is failing: stop the ranks it started, or a hung one would be left orphaned."""
        if not isinstance(exception, SIGTERMException):
            # A failing rank may leave a collective pending: destroying the group would wait for the other ranks (up
            # to the timeout) instead of exiting. A signal's stop is orderly: every rank stopped at the same point.
            atexit.unregister(_end_process_group)
        children = launched_children(trainer)
        if not children:
            return
        timed_out = "timed out" in str(exception).lower() or "timeout" in type(exception).__name__.lower()
        if not timed_out:
            # A rank that raised is already on its way out (printing its traceback): let it finish.
            deadline = time.monotonic() + self.grace
            for proc in children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        alive = [proc for proc in children if proc.poll() is None]
        if not alive:
            return
        reason = (
            f"a collective waited more than watchdog.timeout={self.timeout:g} s: another rank is hung or too slow"
            if timed_out
            else f"this process failed ({type(exception).__name__})"
        )
        pids = ", ".join(str(proc.pid) for proc in alive)
        print(
            f"[rank {trainer.global_rank}] {reason}; killing the job's other processes (PID {pids}). "
            "If a rank legitimately works alone for longer, raise --watchdog.timeout.",
            file=sys.stderr,
            flush=True,
        )
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def end_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, while it is still whole.

    Lightning does this for NCCL only. A gloo group left to the interpreter's finalisation aborts the process now and
    then (``terminate called without an active exception``, SIGABRT, about one exit in ten here with torch 2.13):
    gloo's threads still hold the last collective's work when Python is torn down. A rank that aborts after a
    finished run fails the job (torchrun's agent waits for it at its exit barrier; Lightning's launcher kills the
    other ranks).
    """
    atexit.unregister(_end_process_group)  # registered once, however many Trainers this process sets up
    atexit.register(_end_process_group)


def _end_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
