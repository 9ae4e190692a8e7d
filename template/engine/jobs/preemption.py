"""Stopping on a scheduler's signal or Ctrl-C: a checkpoint at the next safe point, a SLURM requeue, a non-zero exit."""

from __future__ import annotations

import multiprocessing.util
import os
import signal
import sys
import threading
import time
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from template.engine.errors import signal_exit
from template.engine.internals import cluster_environment, stop_as_on_sigterm
from template.engine.jobs.processes import die_with_parent, requeue_slurm_job
from template.engine.logs.console import Mechanism
from template.engine.resume.states import exact_resume_point
from template.engine.runs import INTERRUPTED
from template.engine.runs.folder import checkpoint_dir

_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}
_handled: set[int] = set()  # the signals this process's fit stops on, for the process: its forked workers leave them


class Stop(Enum):
    """Where a fit is in its stop on a signal, the same on every rank once they agree."""

    TRAINING = "no signal: training"
    SIGNALLED = "a signal came (to this rank, or to another as the ranks agreed): the run stops at the next safe point"
    STOPPED = "stopped at a safe point, interrupted.ckpt written: a second signal to this process ends it at once"
    TRAINED = "past the last safe point: a signal stops nothing"
    LATE = "a signal came once training had ended: it stopped nothing (the command's end says so), a second ends it"


class Preemption(Callback):
    """On SIGTERM, SLURM's requeue signal (SIGUSR1) or Ctrl-C, all ranks write ``interrupted.ckpt`` together at the
    next point from which the same command continues exactly, rank zero asks SLURM to requeue the job, and the run
    exits 128 + the signal (docs/reliability.md). The handlers only record the signal (Lightning's own saves inside
    the handler: mid-step, and under DDP in collectives the other ranks are not in). Several processes compare their
    signals every ``stride`` training batches, about ``check_interval`` seconds' worth. A signal once training ended
    stops nothing (``command_ended`` names it); a second one as the run ends ends the process at once. Children forked
    meanwhile (DataLoader workers) leave the signals to the run, so a signal to the whole process group is one stop.

    ``state`` says where the stop is (``Stop``), ``stopping`` whether one is under way (what the exact-resume callback
    asks of a checkpoint), ``signal`` the stop's signal, ``signalled_at`` when this process received its own."""

    announcement = Mechanism(
        "preemption",
        "SIGTERM/SIGUSR1/Ctrl-C save interrupted.ckpt where a resume is exact, exit 128+signal (and requeue on SLURM)",
        "--run.preemption=false",
    )

    def __init__(self, check_interval: float = 1.0) -> None:
        self.check_interval = check_interval
        self._restart_stride()
        self.state = Stop.TRAINING
        self.signal: int | None = None
        self.signalled_at: float | None = None

    @property
    def stopping(self) -> bool:
        return self.state in (Stop.SIGNALLED, Stop.STOPPED)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before Lightning installs its SIGTERM handler (at the sanity check): a signal while the run restores counts.
        if stage != "fit" or signal.getsignal(signal.SIGTERM) == self._record or not _main_thread():
            return
        for signum in (signal.SIGTERM, _requeue_signal(trainer), signal.SIGINT):
            if signum != signal.SIGINT or signal.getsignal(signum) is not signal.SIG_IGN:  # Ctrl-C ignored: nohup
                signal.signal(signum, self._record)
                _handled.add(signum)
        defer_signals(False)  # one sent while the command started is recorded now

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_over_sigterm(trainer)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_over_sigterm(trainer)  # the test after fit: a signal there stops nothing either

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_over_sigterm(trainer)
        self._restart_stride()

    def _restart_stride(self) -> None:
        self._batches = self._agreed_batches = 0  # training batch ends in this fit, and at the last comparison
        self._stride = self._due = 1  # the first comparison after the first batch
        self._agreed_time = time.monotonic()

    def _take_over_sigterm(self, trainer: Trainer) -> None:
        """Replace the SIGTERM handler Lightning installs after ``on_fit_start``, taking over a SIGTERM it recorded
        meanwhile. Lightning puts ours back when the run ends."""
        if signal.SIGTERM not in _handled or not _main_thread():
            return
        if trainer.received_sigterm and self.state is not Stop.STOPPED:  # ours too (Lightning's handler calls it)
            if self.signalled_at is None:
                self._record(signal.SIGTERM, None)
            stop_as_on_sigterm(trainer, stop=False)  # else Lightning stops after the next step, with no checkpoint
        signal.signal(signal.SIGTERM, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled_at is None:  # this process's first
            self.signal, self.signalled_at = self.signal or signum, time.monotonic()
            self.state = {Stop.TRAINING: Stop.SIGNALLED, Stop.TRAINED: Stop.LATE}.get(self.state, self.state)
        elif self.state in (Stop.STOPPED, Stop.LATE):  # a second signal as the run ends: at once
            rank_zero_info(
                f"Stopping at once on a second {signal.Signals(signum).name}: the checkpoints are written, the run's "
                "last logs, record or uploads may not be; run the same command to continue"
            )
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(signal_exit(signum))  # without the interpreter's clean-up, which may be what is slow
        elif signum == signal.SIGINT:
            # A second Ctrl-C: stop now, through Lightning's KeyboardInterrupt shutdown (which kills child ranks).
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt

    # The safe points: every rank is in the same hook, and a checkpoint written there resumes exactly.

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # Lightning ends the loop after this step's logging, as on its own SIGTERM.
        self._batches += 1
        due = self._batches >= self._due if trainer.world_size > 1 else self.state is Stop.SIGNALLED
        if due and exact_resume_point(trainer):
            self._stop_if_signalled(trainer, raise_now=False)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.sanity_checking:
            self._stop_if_signalled(trainer, raise_now=True, save=False)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_if_signalled(trainer, raise_now=False)  # Lightning raises its SIGTERMException after the epoch

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the last step: the checkpoint holds the finished run, from which the same command trains no more.
        self._stop_if_signalled(trainer, raise_now=True)
        if self.state is Stop.TRAINING:
            self.state = Stop.TRAINED

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # A failing run records signals until the command ends: the SIGTERM a launcher sends the surviving ranks must
        # not replace the failure's own line with a stop's.
        if isinstance(exception, SIGTERMException) and self.state is Stop.STOPPED:
            # Lightning's SIGTERMException exits 0. A rank Lightning's launcher started exits 0 too: the launcher
            # reports the job's code, and would kill the job the moment a child exits non-zero, before its logs.
            launched = trainer.local_rank > 0 and isinstance(cluster_environment(trainer), LightningEnvironment)
            exception.code = 0 if launched else signal_exit(self.signal)

    def _stop_if_signalled(self, trainer: Trainer, raise_now: bool, save: bool = True) -> None:
        if self.state is Stop.STOPPED or (signum := self._agreed_signal(trainer)) is None:
            return
        self.signal, self.state = self.signal or signum, Stop.SIGNALLED  # another rank's, maybe: stopping here too
        path = str(Path(checkpoint_dir(trainer)) / INTERRUPTED) if save else ""
        if save:  # the whole training state; the logs up to this step are written first
            trainer.save_checkpoint(path, weights_only=False)
        requeued = _requeue(trainer, signum)
        self.state = Stop.STOPPED
        name, after = signal.Signals(signum).name, self._after()
        then = "the job is requeued and continues by itself" if requeued else "run the same command to continue"
        # In the sanity check nothing is trained yet: the run's newest checkpoint (if any) is where it started.
        done = f": checkpoint {path} written{after}" if save else f" in the sanity check{after}: nothing trained yet"
        rank_zero_info(f"Stopping on {name}{done}; {then}")
        stop_as_on_sigterm(trainer)
        if raise_now:
            raise SIGTERMException(signal_exit(signum))

    def _after(self) -> str:
        return f" {time.monotonic() - self.signalled_at:.2f} s after the signal" if self.signalled_at else ""

    def _agreed_signal(self, trainer: Trainer) -> int | None:
        """The signal any rank received, the same on every rank at the same safe point."""
        if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
            return self.signal
        # Each process proposes the next stride from its own pace; the smallest one is agreed, with the signal.
        batches, now = self._batches - self._agreed_batches, time.monotonic()
        pace = round(self.check_interval * batches / max(now - self._agreed_time, 1e-9)) if batches else self._stride
        proposal = max(1, min(2 * self._stride, pace))
        code = torch.tensor([self.signal or 0, -proposal], device=trainer.strategy.root_device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        signum, stride = code.tolist()
        self._stride, self._agreed_batches, self._agreed_time = -stride, self._batches, now
        self._due = self._batches - stride
        return signum or None


def defer_signals(until_the_fit: bool = True) -> None:
    """While a fit starts the preemption signals wait (blocked), and so do those of the ranks a launcher starts
    meanwhile, through their imports: the fit's Preemption takes them at its setup, where one that waits stops the fit
    at its first safe point. ``until_the_fit=False``: delivered now (a fit without Preemption, a command's end).
    A rank another process started (LOCAL_RANK > 0) dies with it meanwhile: it would not see that signal end it."""
    if until_the_fit and os.environ.get("LOCAL_RANK", "0").strip() not in ("", "0"):
        die_with_parent()
    signal.pthread_sigmask(signal.SIG_BLOCK if until_the_fit else signal.SIG_UNBLOCK, _SIGNALS)


def command_ended(handlers: dict[int, Any] | None, trainer: Trainer | None, finished: bool) -> None:
    """The command is over: a signal received after training ended, which stopped nothing, is named if the command
    ``finished`` writing the run. Then ``handlers`` come back (a caller that goes on, from the main thread), or, for a
    program, the signals are ignored while the interpreter exits: everything is written, its exit code decided."""
    preemption = next((c for c in trainer.callbacks if isinstance(c, Preemption)), None) if trainer else None
    if finished and preemption is not None and preemption.state is Stop.LATE:
        name = signal.Signals(preemption.signal).name
        rank_zero_info(f"{name} came after training ended and stopped nothing: the run's files are all written")
    if _main_thread():
        for signum, handler in (handlers or dict.fromkeys(_SIGNALS | _handled, signal.SIG_IGN)).items():
            if handler is not None and signal.getsignal(signum) != handler:  # None: installed outside Python
                signal.signal(signum, handler)
    _handled.clear()
    defer_signals(False)


def signal_handlers() -> dict[int, Any]:
    """The process's signal handlers now, for ``command_ended`` to put back."""
    return {signum: signal.getsignal(signum) for signum in signal.valid_signals()}


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _after_fork_in_child(_: object) -> None:
    # A child multiprocessing forks while a fit stops on the signals (a DataLoader worker) keeps them blocked, where
    # torch's worker would die of a SIGTERM from anyone but its parent, and leaves them to a thread of its own.
    if _handled:
        signal.pthread_sigmask(signal.SIG_BLOCK, _handled)
        die_with_parent()  # no orphan, whatever ends the run
        threading.Thread(target=_leave_signals_to, args=(os.getppid(), frozenset(_handled)), daemon=True).start()


def _leave_signals_to(parent: int, signals: frozenset[int]) -> None:
    """In a child forked while the run handles ``signals``: the run, which received them too, ends the child when it
    stops; the parent's own SIGTERM (how torch and multiprocessing end a worker) ends it now, as torch's does."""
    while True:
        info = signal.sigwaitinfo(signals)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)


# Once for the process: multiprocessing runs it in each child it starts (a plain os.fork is left alone).
multiprocessing.util.register_after_fork(_after_fork_in_child, _after_fork_in_child)


def _requeue_signal(trainer: Trainer) -> int:
    environment = cluster_environment(trainer)
    return environment.requeue_signal if isinstance(environment, SLURMEnvironment) else signal.SIGUSR1


def _requeue(trainer: Trainer, signum: int) -> bool:
    """Whether the job goes back in SLURM's queue: on its requeue signal with ``auto_requeue`` on, rank zero asks."""
    slurm = cluster_environment(trainer)
    if signum != _requeue_signal(trainer) or not (isinstance(slurm, SLURMEnvironment) and slurm.auto_requeue):
        return False
    failure = requeue_slurm_job() if trainer.is_global_zero else None
    if failure is not None:
        rank_zero_warn(f"{failure}; resubmit the same sbatch command to continue")
    return failure is None
