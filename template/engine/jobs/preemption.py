"""Stopping on a scheduler's signal or Ctrl-C: a checkpoint at the next safe point, a SLURM requeue, a non-zero exit."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from template.engine.internals import cluster_environment, stop_as_on_sigterm
from template.engine.jobs.processes import requeue_slurm_job
from template.engine.logs.console import Mechanism
from template.engine.resume.states import exact_resume_point
from template.engine.runs import INTERRUPTED
from template.engine.runs.folder import checkpoint_dir

# The handlers in place before a run installed its own, restored when the command ends.
_BEFORE_THE_RUN: dict[int, Any] = {}


class Preemption(Callback):
    """On SIGTERM, SLURM's requeue signal (SIGUSR1) or Ctrl-C (SIGINT), write a checkpoint at the next point from which
    the same command continues exactly, and stop with exit code 128 + the signal.

    Lightning's own SLURM handler saves inside the signal handler: in the middle of a step (not an exact resume)
    and, under DDP, with collectives that the other ranks are not in (a hang). Lightning's SIGTERM handling ends the
    run with exit code 0 during the sanity check, the last validation batch or after the last step, and Ctrl-C
    loses the work since the last checkpoint. Here the handlers, installed when fit sets up, only record the signal;
    all ranks agree on it at the same point (``resume.exact_resume_point``: a training batch's end that neither
    accumulates gradients nor precedes a validation or the epoch's end; the end of an epoch; the end of training),
    write ``interrupted.ckpt`` together, rank zero asks SLURM to requeue the job (``scontrol requeue``, when
    Lightning's ``SLURMEnvironment.auto_requeue`` is on), and the run stops. A validation under way is finished first:
    Lightning resumes a checkpoint written inside one inexactly. A signal in the sanity check stops at once without a
    checkpoint: nothing has been trained. A second Ctrl-C stops at once (``KeyboardInterrupt``, Lightning's own
    shutdown).

    Several processes compare their signals in a collective (a host-device sync on GPUs) at a stride of training
    batches that all of them agree on at each comparison: batches worth about ``check_interval`` seconds at the pace
    since the last comparison, at most twice the last stride. The stop is taken at the first safe point at or after
    the next comparison, and at every epoch's end.
    """

    announcement = Mechanism(
        "preemption",
        "SIGTERM/SIGUSR1/Ctrl-C save interrupted.ckpt where a resume is exact, exit 128+signal (and requeue on SLURM)",
        "--run.preemption=false",
    )

    def __init__(self, check_interval: float = 1.0) -> None:
        self.check_interval = check_interval
        self._restart_stride()
        self._received: int | None = None
        self._stopping: tuple[int, str, bool] | None = None
        self.signalled_at: float | None = None
        self._active = False  # between setup and the end of fit the handlers record; after it they end the process

    def _signals(self, trainer: Trainer) -> list[int]:
        return [signal.SIGTERM, _requeue_signal(trainer), signal.SIGINT]

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # From the start of fit, before Lightning installs its SIGTERM handler (just before the sanity check), so
        # that a signal while the run sets up or restores is recorded too.
        if stage != "fit" or self._active or threading.current_thread() is not threading.main_thread():
            return
        self._active = True
        for signum in self._signals(trainer):
            previous = signal.getsignal(signum)
            if signum == signal.SIGINT and previous is signal.SIG_IGN:
                continue  # started with Ctrl-C ignored (nohup, a background job): keep it so
            _BEFORE_THE_RUN.setdefault(signum, previous)
            signal.signal(signum, self._record)

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_over_sigterm(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_over_sigterm(trainer)
        self._restart_stride()

    def _restart_stride(self) -> None:
        self._batches = self._agreed_batches = 0  # training batch ends in this fit, and at the last comparison
        self._stride = self._due = 1  # the first comparison after the first batch
        self._agreed_time = time.monotonic()

    def _take_over_sigterm(self, trainer: Trainer) -> None:
        """Replace the SIGTERM handler Lightning installs after ``on_fit_start`` (it calls ours too, and sets
        ``received_sigterm``, which this reads for a SIGTERM that came in between). Lightning restores the handlers
        it found, ours, when the run ends; outside fit ours pass the signal on."""
        if not self._active or threading.current_thread() is not threading.main_thread():
            return
        if trainer.received_sigterm and self._received is None and self._stopping is None:
            self._record(signal.SIGTERM, None)
        signal.signal(signal.SIGTERM, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if not self._active:
            _after_the_run(signum, frame, _BEFORE_THE_RUN.get(signum, signal.SIG_DFL))
            return
        if signum == signal.SIGINT and self._received is not None:
            # A second Ctrl-C: stop now, through Lightning's KeyboardInterrupt shutdown (which kills child ranks).
            signal.signal(signal.SIGINT, _BEFORE_THE_RUN.get(signal.SIGINT, signal.default_int_handler))
            raise KeyboardInterrupt
        if self._received is None:
            self._received, self.signalled_at = signum, time.monotonic()

    # The points a stop is taken at: every rank is in the same hook, and a checkpoint written there resumes exactly.

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # Lightning ends the loop after this step's logging, as it does on its own SIGTERM handling. One process
        # without a signal has nothing to do; several agree on the signal at the first safe point of their stride.
        self._batches += 1
        due = self._batches >= self._due if trainer.world_size > 1 else self._received is not None
        if due and exact_resume_point(trainer):
            self._stop_if_signalled(trainer, raise_now=False)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.sanity_checking:
            self._stop_if_signalled(trainer, raise_now=True, save=False)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning raises its SIGTERMException after the epoch's end, the last epoch's included.
        self._stop_if_signalled(trainer, raise_now=False)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the last step: the checkpoint holds the finished run, from which the same command trains no more.
        self._stop_if_signalled(trainer, raise_now=True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_after_training()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        try:
            self._stop_after_training()
        finally:
            self._end()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._stopping is not None and isinstance(exception, SIGTERMException):
            # Lightning's SIGTERMException exits 0; a run stopped before its end exits 128 + the signal, as if killed.
            # A rank that Lightning's launcher started exits 0: the launching process reports the job's code, and
            # the launcher kills it the moment a child exits non-zero, before it has written the run's logs.
            exception.code = 0 if _started_by_lightnings_launcher(trainer) else 128 + self._stopping[0]
        if isinstance(exception, SIGTERMException):
            self._end()
        # A failing run (a rank died, the user's code raised) records signals until the command ends: the SIGTERM a
        # launcher sends the surviving ranks must not replace the failure's own line with a stop's.

    def _end(self) -> None:
        """The run is over. Until the command ends (``restore_signal_handlers``) a signal ends the process at once,
        with a line and exit code 128 + the signal: the run's files are written. Lightning reinstalls this handler
        at its teardown."""
        self._active = False

    def _stop_if_signalled(self, trainer: Trainer, raise_now: bool, save: bool = True) -> None:
        if self._stopping is not None:
            return
        signum = self._agreed_signal(trainer)
        if signum is None:
            return
        path = ""
        if save:
            path = str(Path(checkpoint_dir(trainer)) / INTERRUPTED)
            # weights_only=False: the whole training state (Lightning logs a line when it is not said).
            trainer.save_checkpoint(path, weights_only=False)  # the logs up to this step are written first
        requeued = signum == _requeue_signal(trainer) and _auto_requeue(trainer) and _requeue(trainer)
        self._stopping = (signum, path, requeued)
        # A stop before any training step (the sanity check) needs no checkpoint: the run's newest one (none on a
        # first start) is where it started, and a resumed run skips the sanity check.
        name = signal.Signals(signum).name
        then = "the job is requeued and continues by itself" if requeued else "run the same command to continue"
        if save:
            rank_zero_info(f"Stopping on {name}: checkpoint {path} written{self._after()}; {then}")
        else:
            rank_zero_info(f"Stopping on {name} in the sanity check{self._after()}: nothing trained yet; {then}")
        # Lightning ends the loop as on its own SIGTERM handling (other callbacks can read trainer.received_sigterm).
        stop_as_on_sigterm(trainer)
        if raise_now:
            raise SIGTERMException(128 + signum)

    def _stop_after_training(self) -> None:
        """A signal after the last safe point (the end of training): the checkpoints are written, nothing is left to
        save, and no collective is safe (a rank may be past its last one); the run still ends non-zero."""
        if self._stopping is not None or self._received is None or not self._active:
            return
        signum = self._received
        self._stopping = (signum, "", False)
        name = signal.Signals(signum).name
        rank_zero_info(f"Stopping on {name} after training ended{self._after()}: its checkpoints are written")
        raise SIGTERMException(128 + signum)

    def _after(self) -> str:
        return f" {time.monotonic() - self.signalled_at:.2f} s after the signal" if self.signalled_at else ""

    def _agreed_signal(self, trainer: Trainer) -> int | None:
        """The signal any rank received, the same on every rank at the same safe point."""
        if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
            return self._received
        # Each process proposes the next stride from its own pace; the smallest one is agreed, with the signal.
        batches, now = self._batches - self._agreed_batches, time.monotonic()
        pace = round(self.check_interval * batches / max(now - self._agreed_time, 1e-9)) if batches else self._stride
        proposal = max(1, min(2 * self._stride, pace))
        code = torch.tensor([self._received or 0, -proposal], device=trainer.strategy.root_device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        signum, stride = code.tolist()
        self._stride, self._agreed_batches, self._agreed_time = -stride, self._batches, now
        self._due = self._batches - stride
        return signum or None


def _after_the_run(signum: int, frame: FrameType | None, before: Any) -> None:
    """A signal after fit ended: a handler of the caller's own (a notebook, a framework) decides; otherwise the process
    ends now, as the signal's default would, but with a line and exit code 128 + the signal instead of no word."""
    if before is signal.SIG_IGN:
        return
    if callable(before) and before is not signal.default_int_handler:
        before(signum, frame)
        return
    rank_zero_info(f"Stopping on {signal.Signals(signum).name} after the run ended: its files are written")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)  # what the default action does, without the interpreter's clean-up


def restore_signal_handlers() -> None:
    """The command has ended: signals go where they went before its run (for callers that go on, such as tests)."""
    if threading.current_thread() is not threading.main_thread():
        return
    while _BEFORE_THE_RUN:
        signum, handler = _BEFORE_THE_RUN.popitem()
        if handler is not None:
            signal.signal(signum, handler)


def _started_by_lightnings_launcher(trainer: Trainer) -> bool:
    """A child rank of ``strategy: ddp`` without torchrun or SLURM (LightningEnvironment sets LOCAL_RANK for it)."""
    return trainer.local_rank > 0 and isinstance(cluster_environment(trainer), LightningEnvironment)


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
    failure = requeue_slurm_job()
    if failure is not None:
        rank_zero_warn(f"{failure}; resubmit the same sbatch command to continue")
    return failure is None
