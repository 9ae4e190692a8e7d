"""The job's processes: a rank that hangs ends the whole job within a timeout, and none outlives it; a rank that dies
(SIGKILL, a segfault) ends it with one line naming the rank, its signal and the checkpoint to continue from; a child
that ends with its parent; a SLURM requeue; the process group of a torchrun restart."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from pathlib import Path

import torch.distributed as dist
from jsonargparse.typing import NonNegativeFloat, PositiveFloat
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from template.engine import internals
from template.engine.errors import ConfigError, chain, full_traceback, signal_exit
from template.engine.logs.console import Mechanism
from template.engine.runs.folder import checkpoint_dir, newest

# What a collective raises on a surviving rank when a peer's connection closes (gloo), or NCCL when a peer is gone.
_LOST_PEER = re.compile(
    r"Connection (closed|reset) by peer|remote worker crash|Broken pipe|remote process exited|"
    r"NCCL communicator was aborted",
    re.IGNORECASE,
)
_BEFORE_THE_FIRST_STEP = (
    "before the first training step, a collective only some ranks call (e.g. trainer.log_dir under "
    "trainer.is_global_zero, whose broadcast the other ranks never join) waits for the others, or a rank is hung"
)
_LONGEST = 1e9  # seconds: torch keeps a process group's timeout in int64 nanoseconds (up to 9.2e9 s)
_CAUSES = {
    "SIGKILL": " (out of memory, or kill -9 by a user or the scheduler)",
    "SIGSEGV": " (a crash in native code: a library, an extension or a driver)",
    "SIGBUS": " (a crash in native code, or a file it had mapped was truncated)",
    "SIGABRT": " (native code aborted)",
}


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Ask Linux to send this process ``signum`` when its parent exits (0: nothing); elsewhere this is a no-op."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG


def requeue_slurm_job() -> str | None:
    """Ask SLURM to put this job (or this array task) back in the queue: None when it accepted, else why not."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "")
    if not job or shutil.which("scontrol") is None:  # e.g. inside a container image without SLURM's tools
        what = "scontrol is not on PATH here (SLURM's tools are outside this image?)" if job else "no SLURM_JOB_ID"
        return f"cannot ask SLURM to requeue job {job or '(unknown)'}: {what}"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job} failed ({err})"
    return None if done.returncode == 0 else f"scontrol requeue {job} failed: {done.stderr.strip()}"


def join_restarted_group(trainer: Trainer) -> None:
    """After a torchrun restart, create the process group (which Lightning then keeps) under keys of its own attempt,
    ``attempt_<n>/``: the agent's TCPStore outlives an attempt, and restarted workers reading the dead workers'
    addresses from it fail to connect ("Connection refused")."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    environment = getattr(trainer.strategy, "cluster_environment", None)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not (restart and agent_store and isinstance(environment, TorchElasticEnvironment)) or dist.is_initialized():
        return
    if (backend := internals.process_group_backend(trainer.strategy)) is None:
        return
    timeout = internals.process_group_timeout(trainer.strategy) or timedelta(minutes=30)
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


class Role(Enum):
    """Which process of the job this one is, which decides what its watchdog does when the job fails."""

    ALONE = "the job's one process"
    LAUNCHER = "a process that started ranks (Lightning's launcher): it ends them and names the one that died"
    LAUNCHED = "a rank Lightning's launcher started: it waits for the launcher's word, and names the launcher's death"
    APART = "a rank started apart (torchrun, SLURM): it says a peer died, which the launcher then names"

    @classmethod
    def of(cls, trainer: Trainer) -> Role:
        if trainer.local_rank > 0 and isinstance(internals.cluster_environment(trainer), LightningEnvironment):
            return cls.LAUNCHED
        if internals.launched_children(trainer):
            return cls.LAUNCHER
        return cls.APART if trainer.world_size > 1 else cls.ALONE


class RankWatchdog(Callback):
    """Bounds how long a process waits for the others, then takes the whole job down; names the rank that died (its
    signal, the checkpoint to continue from); ends each rank's process group at exit. What it does is its ``role``'s.

    Args:
        timeout: seconds a collective (all-reduce, barrier) may wait for the other processes before the job
            fails. It also bounds how long one rank may work alone while the others wait, e.g. a long
            ``prepare_data`` download on rank 0: raise it for such work.
        grace: seconds the launching process gives its child ranks to exit on their own after an error (not after
            a timeout: then a rank is hung; after a stop they get ``timeout``) before killing them, and itself to
            fail on its own after a child rank died before it reports that rank.
        setup_timeout: the bound instead of ``timeout`` from a fit's setup to its first training step (the module's
            setup, ``on_fit_start``, the checkpoint's restore, the sanity check), where a collective only some ranks
            call (e.g. ``trainer.log_dir`` under ``trainer.is_global_zero``) waits for the others; raise it where
            ranks legitimately wait longer for one another there.
    """

    announcement = Mechanism(
        "hang watchdog",
        "a rank waiting longer than watchdog.timeout s ends the job; each rank ends its process group at exit",
        "none; raise --watchdog.timeout (Lightning's: 1800)",
    )

    def __init__(
        self, timeout: PositiveFloat = 600.0, grace: NonNegativeFloat = 3.0, setup_timeout: PositiveFloat = 120.0
    ) -> None:
        if not timeout <= _LONGEST:  # inf, or beyond the nanoseconds torch's process group counts in
            raise ConfigError(
                f"watchdog.timeout={timeout:g} is longer than a process group can wait: give at most {_LONGEST:g} s"
            )
        self.timeout = timeout
        self.grace = grace
        self.setup_timeout = setup_timeout
        self._bound = "timeout"  # the option bounding a collective now
        self._kept: timedelta | None = None  # the process group's own bound, from the first training step on
        self.role = Role.ALONE  # this process's, known at setup
        self._dead: DeadRank | None = None  # as the launcher: the child rank whose death made it fail
        self._failing: threading.Event | None = None  # set when the launcher fails: it reports a dead child itself

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._dead = None
        # Made here, in each process: ddp_spawn pickles the callbacks, and an Event does not pickle.
        self._failing = threading.Event()
        # Lightning's launcher would SIGKILL this process the moment a child exits non-zero, saying nothing of it.
        internals.on_child_failure(lambda: self._child_failed(trainer))
        before, self.role = self.role, Role.of(trainer)
        if self.role is Role.LAUNCHED:
            if before is not Role.LAUNCHED:  # else set up again (the test after fit): already watched
                self._watch_launcher(trainer)  # rank 0 started this rank: its death is this rank's to report
        elif trainer.local_rank > 0:
            # A child rank dies with the process that started it (torchrun's agent), even when that one is SIGKILLed
            # and runs no cleanup: a hung child would otherwise live on as an orphan.
            die_with_parent()
        if dist.is_available() and dist.is_initialized():
            self._kept = internals.process_group_timeout(trainer.strategy)  # the watchdog's, or the strategy's own
            if stage == "fit" and self._kept and self.setup_timeout < self._kept.total_seconds():
                self._bound_by("setup_timeout", timedelta(seconds=self.setup_timeout))
            # Lightning destroys an NCCL group only: a gloo one left to the interpreter's finalisation now and then
            # aborts the process ("terminate called without an active exception"), failing a finished job.
            atexit.unregister(_end_process_group)  # once, however many Trainers this process sets up
            atexit.register(_end_process_group)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._bound != "timeout":
            self._bound_by("timeout", self._kept)

    def _bound_by(self, option: str, timeout: timedelta) -> None:
        self._bound = option
        internals.set_process_group_timeout(timeout)  # the group Lightning created, which its strategy holds

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """As the launcher, stop the ranks it started (a hung one would be left orphaned); as a rank started apart,
        say that a peer died before the launcher's SIGTERM to the ranks left ends this one with a line of its own."""
        if not isinstance(exception, SIGTERMException):
            # A collective may be pending: destroying the group would wait for the other ranks, up to the timeout.
            atexit.unregister(_end_process_group)
        timed_out = "timed out" in str(exception).lower() or "timeout" in type(exception).__name__.lower()
        role = Role.of(trainer)  # also where the job failed before this callback's setup (a process group's start)
        if role is Role.APART and not timed_out and lost_peer(exception):
            _report_and_exit(DeadRank(None, None, None, _newest_checkpoint(trainer)), exception)
        elif role is Role.LAUNCHER:
            self._end_children(trainer, exception, timed_out)
        elif role is Role.LAUNCHED and timed_out:
            # The launcher's collective, if it waits too, times out about now: its line names the hang, then it ends
            # this rank, whose own exit would have the job blamed on it ("rank 1 exited with code 1").
            time.sleep(self.grace)

    def _end_children(self, trainer: Trainer, exception: BaseException, timed_out: bool) -> None:
        children = internals.launched_children(trainer) or []
        if self._failing is not None:
            self._failing.set()
        if not timed_out:
            # A rank that raised is already on its way out (printing its traceback): let it finish. After a stop all
            # ranks agreed on (SIGTERM, Ctrl-C) each is ending normally, which on a loaded machine outlasts `grace`.
            deadline = time.monotonic() + (self.timeout if isinstance(exception, SIGTERMException) else self.grace)
            for proc in children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            # The rank that died on its own (not killed below) is why this process failed: the job reports it.
            self._dead = self._dead or _first_dead(trainer, children)
        alive = [proc for proc in children if proc.poll() is None]
        if alive and self._dead is None:
            reason = (
                f"a collective waited more than watchdog.{self._bound}={getattr(self, self._bound):g} s: "
                + ("another rank is hung or too slow" if self._bound == "timeout" else _BEFORE_THE_FIRST_STEP)
                if timed_out
                else f"this process failed ({type(exception).__name__})"
            )
            pids = ", ".join(str(proc.pid) for proc in alive)
            print(
                f"[rank {trainer.global_rank}] {reason}; killing the job's other processes (PID {pids}). "
                f"If a rank legitimately works alone for longer, raise --watchdog.{self._bound}.",
                file=sys.stderr,
                flush=True,
            )
        _kill(alive)

    def dead_rank(self, err: BaseException) -> DeadRank | None:
        """The rank whose death made this process fail with ``err``, if this process knows it (the launcher knows its
        children's). A rank it started waits here for the launcher's word first (rank 0 reports a dead rank and kills
        this one; if rank 0 died, this rank's launcher watch says so)."""
        if self._dead is None and self.role is Role.LAUNCHED and lost_peer(err):
            time.sleep(self.grace + 10)
        return self._dead

    def _child_failed(self, trainer: Trainer) -> None:
        """Lightning's launcher saw a child exit non-zero (in its watching thread). This process reports the dead rank
        when its next collective fails (``on_exception``); one that does not within ``grace`` is ended here."""
        if self._failing is not None and self._failing.wait(self.grace):
            return
        children = internals.launched_children(trainer) or []
        dead = _first_dead(trainer, children)
        if dead is not None:
            _kill([proc for proc in children if proc.poll() is None])
            _report_and_exit(dead)

    def _watch_launcher(self, trainer: Trainer) -> None:
        """When rank 0, which started this rank, dies without ending it (SIGKILL, a segfault), say so in one line and
        end, even while this rank is busy or hung."""
        die_with_parent(0)  # the start's (preemption.defer_signals): from here this watch says why, then ends
        parent, rank = os.getppid(), trainer.global_rank - trainer.local_rank

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.2)
            _report_and_exit(DeadRank(rank, parent, None, _newest_checkpoint(trainer)))

        threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def dead_rank(err: BaseException, trainer: Trainer | None) -> DeadRank | None:
    """The rank whose death made this process fail with ``err``, as ``trainer``'s hang watchdog knows it."""
    watchdogs = [c for c in trainer.callbacks if isinstance(c, RankWatchdog)] if trainer is not None else []
    return watchdogs[0].dead_rank(err) if watchdogs else None


@dataclass(frozen=True)
class DeadRank:
    """A rank that ended while the job ran: ``returncode`` as Popen gives it (-N: killed by signal N; None: unknown
    here), and the newest checkpoint. ``rank`` is None where each rank is started apart (torchrun, SLURM)."""

    rank: int | None
    pid: int | None
    returncode: int | None
    checkpoint: str | None

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process killed by one; a rank that exited passes its code on."""
        if self.returncode is None:
            return 1
        return signal_exit(-self.returncode) if self.returncode < 0 else self.returncode

    def line(self) -> str:
        """Which rank died and how, and where the same command continues from."""
        who = f"rank {self.rank} (PID {self.pid})"
        if self.rank is None:
            what = (
                "another rank of the job ended while this one waited for it (the collective's connection closed): "
                "the launcher's report names which and how"
            )
        elif self.returncode is None:
            what = (
                f"{who}, which started this process, ended without stopping it: killed by a signal (out of memory, "
                "kill -9) or crashed; the job's exit status names the signal (137: SIGKILL, 139: SIGSEGV)"
            )
        elif self.returncode < 0:
            name = {s.value: s.name for s in signal.Signals}.get(-self.returncode, f"signal {-self.returncode}")
            what = f"{who} was killed by {name}{_CAUSES.get(name, '')}; the job stops with exit code {self.exit_code}"
        else:
            what = f"{who} exited with code {self.returncode} (its own output says why); the job stops with it"
        if self.checkpoint is None:
            return f"{what}; no checkpoint was written yet: the same command starts from the beginning"
        return f"{what}; run the same command to continue from {self.checkpoint}"


def _report_and_exit(dead: DeadRank, exception: BaseException | None = None) -> None:
    """Print ``dead``'s line and end this process now, from any thread (the main one may be blocked in a collective)."""
    if exception is not None and full_traceback():
        traceback.print_exception(exception)
    print(f"error: {dead.line()}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(dead.exit_code)


def _newest_checkpoint(trainer: Trainer) -> str | None:
    try:
        return newest([Path(checkpoint_dir(trainer))])
    except Exception:  # a trainer that failed before its loggers and checkpoint folder were set up
        return None


def _first_dead(trainer: Trainer, children: list[subprocess.Popen]) -> DeadRank | None:
    """The child rank that ended non-zero, a signal's death first (a rank that exited may have lost that one)."""
    ended = [(i, proc) for i, proc in enumerate(children) if proc.poll() not in (None, 0)]
    if not ended:
        return None
    i, proc = min(ended, key=lambda item: (item[1].returncode > 0, item[0]))
    return DeadRank(trainer.global_rank + i + 1, proc.pid, proc.returncode, _newest_checkpoint(trainer))


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective's failure because another rank of the job is gone."""
    return any(isinstance(e, dist.DistNetworkError) or _LOST_PEER.search(str(e)) for e in chain(err))


def _end_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
