"""The sweep's driver: asks Optuna for trials, runs each as its own ``fit`` process, reports, prunes, records."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import optuna
import yaml
from optuna.trial import TrialState

from template.engine.errors import ConfigError
from template.engine.jobs.processes import die_with_parent, requeue_slurm_job
from template.engine.store import atomic_write
from template.engine.sweep.fitconfig import FitConfigs, trial_config
from template.engine.sweep.options import Param, Sweep
from template.engine.sweep.reporter import MEMORY_FRACTION, NOT_LOGGED, REPORTS

_POLL = 0.1  # seconds between looks at the running trials
_STALE_HEARTBEATS = 4  # a running trial silent this many heartbeats belongs to a dead worker
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
_HELD_LOCKS: list[int] = []
_EXCEPTION = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b(: |$)")
FOLD = "data.fold"  # the DataModule's fold (folds.PROTOCOL), set for each fold's run
FOLD_SCORES = "fold_scores"  # with cv.folds: a trial's user attribute, the best objective of each fold it ran


@dataclass
class Running:
    """One trial process and what the driver has read from it."""

    trial: optuna.trial.Trial
    folder: str  # its run folder in the sweep folder
    process: subprocess.Popen
    log: TextIO
    started: float
    reported: set[int]
    values: dict[int, float] = field(default_factory=dict)
    offset: int = 0
    ending: str | None = None  # "pruned" or a failure reason once the driver stopped it
    heartbeat: float = 0.0


class Driver:
    """Runs ``sweep.workers`` trials at once on one study until it holds ``n_trials`` finished ones.

    With ``folds`` (``--cv.folds`` in a sweep) a trial is a cross-validation: its folds run one after another in its
    worker slot, each a ``fit`` in ``<trial>/fold-<k>/``; after each, the mean of the folds' best values so far is
    the trial's intermediate value at step k (what the pruner compares), and the mean over all folds its value.
    """

    label = "Sweep"  # its lines on the console start with this and the study's name

    def __init__(
        self,
        sweep: Sweep,
        space: list[Param],
        configs: FitConfigs,
        storage: optuna.storages.BaseStorage,
        study: optuna.Study,
        folder: Path,
        slots: list[str],
        gpus: dict[str, str] | None = None,
        folds: int = 0,
    ) -> None:
        self.sweep, self.space, self.configs, self.storage, self.study = sweep, space, configs, storage, study
        self.study_id = storage.get_study_id_from_name(sweep.name)
        self.monitor = sweep.objective
        self.direction = sweep.direction
        self.folder = folder
        self.slots = slots
        self.gpus = gpus or {}
        self.folds = folds
        self.running: dict[str, Running] = {}
        self.failures_in_a_row = 0
        self.stop_signal: int | None = None
        self.title = f"{self.label} {sweep.name}"

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        last_stale_check = 0.0
        while True:
            for slot in list(self.running):
                self._poll(slot)
            if self.stop_signal is not None:
                return self._stop()
            if self.failures_in_a_row >= self.sweep.max_failures:
                self._terminate_all("failed")
                many = f"{self.failures_in_a_row} trials failed in a row (sweep.max_failures={self.sweep.max_failures})"
                last = self._last_failure()
                reason = f"{many}; the last: {last}" if self.sweep.max_failures > 1 else last.replace(": error:", ":")
                print(f"error: {reason}; fix it and run the same command", file=sys.stderr)
                return 1
            if time.monotonic() - last_stale_check > self.sweep.heartbeat:
                last_stale_check = time.monotonic()
                self._retry_stale()
            for slot in self.slots:
                if slot not in self.running:
                    self._start_next(slot)
            if not self.running and self._finished() >= self.sweep.n_trials:
                return 0
            time.sleep(_POLL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_signal = signum

    def _stop(self) -> int:
        """Stop the trials with their checkpoints; they stay running in the study and the same command continues."""
        self._terminate_all(None)
        name = signal.Signals(self.stop_signal).name
        print(f"{self.title}: stopped on {name}; run the same command to continue", file=sys.stderr)
        if self.stop_signal == signal.SIGUSR1 and os.environ.get("SLURM_JOB_ID"):
            failure = requeue_slurm_job()
            if failure is not None:
                print(f"{self.title}: {failure}; submit the same command again to continue", file=sys.stderr)
        return 128 + self.stop_signal

    # -- choosing the next trial -----------------------------------------------------------------------------------
    def _start_next(self, slot: str) -> None:
        trials = self.study.get_trials(deepcopy=False)
        mine = [
            t
            for t in trials
            if t.state == TrialState.RUNNING
            and t.user_attrs.get("worker") == slot
            and all(r.trial.number != t.number for r in self.running.values())
        ]
        if mine:
            # This worker was killed with the trial in hand (before it started, while it ran, or before its end was
            # recorded): it takes it up again, from its checkpoint if it has one.
            frozen = mine[0]
            trial = optuna.trial.Trial(self.study, self._id(frozen))
        else:
            if sum(1 for t in trials if t.state in _FINISHED) >= self.sweep.n_trials:
                return
            live = [t for t in trials if _counts(t)]
            if len(live) >= self.sweep.n_trials and not any(t.state == TrialState.WAITING for t in trials):
                return
            frozen = None
            trial = self.study.ask()
            # First of all: started again, this worker finds the trial whatever the moment it was killed at.
            trial.set_user_attr("worker", slot)
        if "started" not in trial.user_attrs:
            earlier = [t for t in self.study.get_trials(deepcopy=False) if _counts(t) and t.number < trial.number]
            if len(earlier) >= self.sweep.n_trials:
                # Another worker asked at the same moment and took the last place.
                trial.set_user_attr("surplus", True)
                self.study.tell(trial, state=TrialState.FAIL)
                return
        self._launch(slot, trial, frozen)

    def trial_folder(self, trial: optuna.trial.Trial) -> str:
        """The folder of a new trial, its values chosen."""
        return f"trial-{trial.number:04d}"

    def who(self, trial: optuna.trial.Trial | optuna.trial.FrozenTrial) -> str:
        """The trial as the console names it."""
        return f"trial {trial.number}"

    def _launch(self, slot: str, trial: optuna.trial.Trial, resumed: optuna.trial.FrozenTrial | None) -> None:
        for param in self.space:
            _suggest(trial, param)  # values it has are kept; the sampler chooses the others (all, for a new trial)
        folder = trial.user_attrs.get("folder") or self.trial_folder(trial)  # a retried trial keeps its folder
        trial.set_user_attr("folder", folder)
        self._beat(trial)
        params = dict(trial.params)
        run, values = folder, params
        if self.folds:  # the first fold without a score: a restart continues it, or starts the next
            fold = len(trial.user_attrs.get(FOLD_SCORES, []))
            run, values = f"{folder}/fold-{fold}", {**params, FOLD: fold}
            (self.folder / folder).mkdir(exist_ok=True)
        config = self.configs.complete(values, what=f"trial {trial.number}: ")
        config = trial_config(config, f"{self.sweep.name}/{run}", self.monitor, self.sweep.name, run)
        config_path = self.folder / f"{run}.yaml"
        text = yaml.safe_dump(config, sort_keys=False)
        atomic_write(config_path, lambda f: f.write(text.encode()))
        log = (self.folder / f"{run}.log").open("a")
        command = [sys.executable, "-m", __package__.split(".")[0], "fit", "--config", str(config_path)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # the trial is not a SLURM task
        if slot in self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[slot]
        if self.sweep.gpu_memory_fraction is not None:
            env[MEMORY_FRACTION] = str(self.sweep.gpu_memory_fraction)  # the trial's reporter applies it on a GPU
        what = "continues" if "started" in trial.user_attrs and (self.folder / run).is_dir() else "starts"
        trial.set_user_attr("started", time.time())  # before the process: a trial that may have run is no surplus
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=_dies_with_us
        )
        reported = set(resumed.intermediate_values) if resumed is not None else set()
        self.running[slot] = Running(trial, run, process, log, time.monotonic(), reported)
        shown = ", ".join(f"{k}={_short(v)}" for k, v in params.items())
        print(f"{self.title}: {self.who(trial)} {what} in {self.folder / run} ({shown})", flush=True)

    # -- a running trial ---------------------------------------------------------------------------------------------
    def _poll(self, slot: str) -> None:
        running = self.running[slot]
        self._read_reports(running)
        if time.monotonic() - running.heartbeat > self.sweep.heartbeat:
            self._beat(running.trial, running)
        code = running.process.poll()
        if code is None:
            return
        self._read_reports(running)
        running.log.close()
        del self.running[slot]
        if self.stop_signal is not None and running.ending is None:
            return  # stopped by the sweep's own signal: still running in the study, continued by the next start
        self._record(running, code)

    def _read_reports(self, running: Running) -> None:
        path = self.folder / running.folder / REPORTS
        if running.ending is not None or not path.is_file():
            return
        with path.open() as f:
            f.seek(running.offset)
            lines = f.readlines()
        for line in lines:
            if not line.endswith("\n"):
                break  # still being written
            running.offset += len(line.encode())
            record = json.loads(line)
            step, value = int(record["step"]), float(record["value"])
            running.values[step] = value
            if not math.isfinite(value):
                self._end(running, f"{self.monitor} is {value} at step {step}")
                return
            if step in running.reported or self.folds:  # with folds the trial reports per fold, not per validation
                continue
            running.reported.add(step)
            running.trial.report(value, step)
            if self.sweep.pruner != "none" and running.trial.should_prune():
                self._end(running, "pruned")
                return

    def _end(self, running: Running, why: str | None) -> None:
        """Stop the trial between two steps: its SIGTERM handler writes a checkpoint first."""
        running.ending = why
        with contextlib.suppress(ProcessLookupError):
            running.process.send_signal(signal.SIGTERM)

    def _record(self, running: Running, code: int) -> None:
        trial, seconds = running.trial, time.monotonic() - running.started
        trial.set_user_attr("seconds", round(seconds + float(_attr(self.study, trial, "seconds") or 0), 1))
        trial.set_user_attr("ended", time.time())
        value = None
        if running.ending is None and code == 0 and running.values:
            value = (max if self.direction == "maximize" else min)(running.values.values())
            if self.folds:
                value = self._fold_ended(running, value)
                if value is None and running.ending is None:
                    return  # still running in the study, this worker's: _start_next runs its next fold
        if running.ending == "pruned":
            self.study.tell(trial, state=TrialState.PRUNED)
            self.failures_in_a_row = 0
        elif running.ending is not None:
            self._fail(trial, running.ending)
        elif value is not None:
            self.study.tell(trial, value)
            self.failures_in_a_row = 0
        else:
            reason = _reason(self.folder / f"{running.folder}.log", code) if code else "no validation ran"
            self._fail(trial, reason)
            if NOT_LOGGED in reason:
                self._terminate_all("stopped")
                raise ConfigError(reason.removeprefix("error: "))
        self._progress(trial.number)

    def _fold_ended(self, running: Running, best: float) -> float | None:
        """A fold's best value recorded and the running mean reported at step k; the mean once the last fold ended,
        else None: the next fold runs unless the pruner stops the trial here."""
        trial = running.trial
        scores = [*trial.user_attrs.get(FOLD_SCORES, []), best]
        mean = statistics.fmean(scores)
        # The report first: killed between the two writes, the fold runs again (to its end, from its checkpoint) and
        # its report is there; the other order would leave the fold scored but never reported.
        if len(scores) - 1 not in running.reported:
            trial.report(mean, len(scores) - 1)
        trial.set_user_attr(FOLD_SCORES, scores)
        if len(scores) == self.folds:
            return mean
        if self.sweep.pruner != "none" and trial.should_prune():
            running.ending = "pruned"
        return None

    def _fail(self, trial: optuna.trial.Trial, reason: str) -> None:
        trial.set_user_attr("reason", reason)
        self.study.tell(trial, state=TrialState.FAIL)
        self.failures_in_a_row += 1

    def _beat(self, trial: optuna.trial.Trial, running: Running | None = None) -> None:
        trial.set_user_attr("heartbeat", time.time())
        if running is not None:
            running.heartbeat = time.monotonic()

    def _retry_stale(self) -> None:
        """Trials of a worker that died elsewhere (silent heartbeat) are failed and queued again, in their folder."""
        now = time.time()
        storage = self.storage
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            # A worker killed right after Optuna created its trial left neither a heartbeat nor its id.
            beat = t.user_attrs.get("heartbeat") or t.datetime_start.timestamp()
            if now - beat < _STALE_HEARTBEATS * self.sweep.heartbeat:
                continue
            if t.user_attrs.get("worker") in self.slots:
                continue  # ours: continued by _start_next
            worker = t.user_attrs.get("worker", "that asked for it")
            try:  # the reason first: Optuna refuses to change a finished trial
                storage.set_trial_user_attr(self._id(t), "reason", f"worker {worker} stopped")
                storage.set_trial_state_values(self._id(t), state=TrialState.FAIL)
            except (RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
                continue  # another worker failed it first
            if t.params:  # else it never started: the next trial asked replaces it
                kept = {k: t.user_attrs[k] for k in ("folder", FOLD_SCORES) if k in t.user_attrs}  # its ended folds
                self.study.enqueue_trial(t.params, user_attrs={**kept, "retry_of": t.number}, skip_if_exists=False)

    def _id(self, trial: optuna.trial.FrozenTrial) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, trial.number)

    # -- output ----------------------------------------------------------------------------------------------------
    def _finished(self) -> int:
        return sum(1 for t in self.study.get_trials(deepcopy=False) if t.state in _FINISHED)

    def _progress(self, number: int) -> None:
        trials = self.study.get_trials(deepcopy=False)
        done = sum(1 for t in trials if t.state in _FINISHED)
        frozen = trials[number]
        reason = frozen.user_attrs.get("reason", "")
        score = f"{self.monitor}={frozen.value:.6g}" if frozen.value is not None else reason
        best = ""
        with contextlib.suppress(ValueError):
            best = f"; best {self.monitor}={self.study.best_value:.6g} ({self.who(self.study.best_trial)})"
        state = frozen.state.name.lower()
        print(f"{self.title}: {done}/{self.sweep.n_trials} finished; {self.who(frozen)} {state} ({score}){best}")
        sys.stdout.flush()

    def _last_failure(self) -> str:
        trials = self.study.get_trials(deepcopy=False)
        failed = [t for t in trials if t.state == TrialState.FAIL and "reason" in t.user_attrs]
        return f"{self.who(failed[-1])}: {failed[-1].user_attrs['reason']}" if failed else "?"

    def _terminate_all(self, why: str | None) -> None:
        """Stop every trial between two steps and wait for it; ``why`` None leaves them running in the study."""
        for running in self.running.values():
            self._end(running, why)
        for running in self.running.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                running.process.wait(timeout=600)
            running.log.close()


def claim_slots(folder: Path, workers: int) -> list[str]:
    """Worker ids ``<host>.<n>`` for this process, each locked while it lives (the kernel frees a dead one's lock).

    A trial records the worker running it: started again, the same worker id continues its trial at once.
    """
    locks = folder / "workers"
    locks.mkdir(parents=True, exist_ok=True)
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    # A requeued array task may land on another node: it keeps its id.
    host = f"slurm-{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}" if array else socket.gethostname()
    host = host.split(".")[0] or "host"
    slots: list[str] = []
    n = 0
    while len(slots) < workers:
        fd = os.open(locks / f"{host}.{n}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
        else:
            _HELD_LOCKS.append(fd)  # open for the life of the process
            slots.append(f"{host}.{n}")
        n += 1
    return slots


def _counts(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial takes one of the ``n_trials`` places: finished, running or queued, not failed."""
    return trial.state != TrialState.FAIL


def _suggest(trial: optuna.trial.Trial, param: Param) -> Any:
    d = param.distribution()
    if isinstance(d, optuna.distributions.CategoricalDistribution):
        return trial.suggest_categorical(param.key, d.choices)
    if isinstance(d, optuna.distributions.IntDistribution):
        return trial.suggest_int(param.key, d.low, d.high, step=d.step, log=d.log)
    return trial.suggest_float(param.key, d.low, d.high, step=d.step, log=d.log)


def _attr(study: optuna.Study, trial: optuna.trial.Trial, key: str) -> Any:
    return study.get_trials(deepcopy=False)[trial.number].user_attrs.get(key)


def _reason(log: Path, code: int) -> str:
    """The one line that says why a trial process failed: its ``error:`` line, else the root exception's line."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    # The log holds every start of the trial: read the last one's.
    text = text[max(text.rfind("\nRun "), 0) :]
    lines = [line.rstrip() for line in text.splitlines()]
    for line in reversed(lines):
        if line.startswith("error:"):
            # Read in the sweep's table, where the traceback is not: it is in the trial's log.
            return line.replace("its traceback follows", f"its traceback is in {log.name}")[:300]
    # Python prints a chain of exceptions root cause first.
    for line in lines:
        if _EXCEPTION.match(line):
            return line[:300]
    return f"exit code {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _dies_with_us() -> None:
    """A trial gets SIGTERM (and so writes its checkpoint) when the driver dies, instead of running on unowned."""
    die_with_parent(signal.SIGTERM)
