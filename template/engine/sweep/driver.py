"""The driver: asks Optuna for trials, runs each (each of its folds) as a ``fit`` process in a worker slot with its own
GPUs, reports, prunes, records. A trial's process is forked from a server that has imported torch, Lightning and the
engine once for the sweep (Python's multiprocessing forkserver, started by ``main``), then becomes ``python -m
<package> fit``."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import posixpath
import re
import runpy
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy
import optuna
import torch
import yaml
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import FrozenTrial, Trial, TrialState

from template.engine import internals
from template.engine.errors import ConfigError, signal_exit
from template.engine.jobs.processes import requeue_slurm_job
from template.engine.runs import Status, read_starts
from template.engine.runs.provenance import write_starts
from template.engine.store import Lock, atomic_write, try_lock
from template.engine.strategies.devices import gpu_count
from template.engine.sweep import start_fork_server
from template.engine.sweep.folds import FOLD
from template.engine.sweep.options import Configs, Sweep
from template.engine.sweep.reporter import NOT_LOGGED, REPORTER, REPORTS

STOPS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # stop the trials with a checkpoint, to be continued
STALE_HEARTBEATS = 4  # a running trial silent this many heartbeats belongs to a dead worker
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
# A tracker's arguments that group the trials by sweep and name each one.
GROUPED = {"MLFlowLogger": ("experiment_name", "run_name"), "WandbLogger": ("group", "name")}


class Life(str, Enum):
    """A trial's life, as the driver records it in the trial's Optuna user attributes (in the order it writes them),
    where every worker and a later command read it; the trial's state is Optuna's."""

    WORKER = "worker"  # asked by this worker slot: started again, the same worker continues it at once
    SURPLUS = "surplus"  # asked at the same moment as another worker's, for the last place: failed, never run
    FOLDER = "folder"  # its folder in the study's (a retry keeps it)
    HEARTBEAT = "heartbeat"  # time.time() its worker last lived; silent STALE_HEARTBEATS times: failed and retried
    STARTED = "started"  # time.time() its process last started: it may have run, so it is no surplus
    FOLD_SCORES = "fold_scores"  # the best objective of each fold it ran, in order
    SECONDS = "seconds"  # its processes' time, over every start
    ENDED = "ended"  # time.time() its process last ended
    REASON = "reason"  # why it failed, one line
    RETRY_OF = "retry_of"  # the trial a worker that died left, which this one continues in its folder
    __str__ = str.__str__


@dataclass
class Running:
    """A trial's fit process (one of its folds), and what the driver has read from it."""

    trial: Trial
    folder: str  # in the study's folder
    fold: int | None  # None: one fit on the DataModule's own split, reported at each validation
    process: multiprocessing.process.BaseProcess
    reported: set[int]
    started: float = field(default_factory=time.monotonic)
    heartbeat: float = field(default_factory=time.monotonic)
    values: dict[int, float] = field(default_factory=dict)
    offset: int = 0
    ending: Status | None = None  # PRUNED or FAILED (``reason``) once the driver stopped it
    reason: str = ""


@dataclass
class Driver:
    """Runs ``sweep.workers`` trials at once until the study holds ``n_trials`` finished ones. A trial is one fit,
    reported at each validation; with ``folds``, its folds one after another (``<trial folder>/fold-<k>/``), reported
    as the running mean of their best values. A cv's trials are a fold each."""

    sweep: Sweep
    space: dict[str, BaseDistribution]
    configs: Configs
    storage: optuna.storages.BaseStorage
    study: optuna.Study
    folder: Path
    slots: list[str]
    gpus: dict[str, str]
    env: dict[str, str]  # the trials' whole environment
    title: str  # its console lines' start
    folds: int = 0
    running: dict[str, Running] = field(default_factory=dict)
    failures_in_a_row: int = 0
    stop_signal: int | None = None
    starts: multiprocessing.context.BaseContext | None = None  # how trial processes start: run() picks it

    def run(self) -> int:
        """Run trials until the study holds ``n_trials`` finished ones (0), too many failed in a row (1) or a signal
        stopped them to be continued (128 + it). Its signal handlers stay: the caller restores its own."""
        for signum in STOPS:
            signal.signal(signum, self._on_signal)
        fresh = start_fork_server()  # running already: started as the command started
        self.starts = multiprocessing.get_context("spawn" if fresh else "forkserver")
        if fresh:
            print(f"{self.title}: each trial starts a fresh interpreter ({fresh})", flush=True)
        last_stale_check = 0.0
        while True:
            for slot in list(self.running):
                self._poll(slot)
            if self.stop_signal is not None:
                return self._stop()
            if self.failures_in_a_row >= self.sweep.max_failures:
                return self._give_up()
            if time.monotonic() - last_stale_check > self.sweep.heartbeat:
                last_stale_check = time.monotonic()
                self._retry_stale()
            for slot in self.slots:
                if slot not in self.running:
                    self._start_next(slot)
            if not self.running and sum(t.state in FINISHED for t in self._trials()) >= self.sweep.n_trials:
                return 0
            time.sleep(0.1)

    def _give_up(self) -> int:
        """Stop the trials that run (the same command continues them) after ``max_failures`` failed in a row."""
        self._terminate_all()
        many = f"{self.failures_in_a_row} trials failed in a row (sweep.max_failures={self.sweep.max_failures})"
        failed = [t for t in self._trials() if t.state == TrialState.FAIL and Life.REASON in t.user_attrs]
        last = f"{who(failed[-1])}: {failed[-1].user_attrs[Life.REASON]}"
        reason = f"{many}; the last: {last}" if self.sweep.max_failures > 1 else last.replace(": error:", ":")
        print(f"error: {reason}; fix it and run the same command", file=sys.stderr)
        return 1

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_signal = signum

    def _stop(self) -> int:
        """Stop the trials with their checkpoints; they stay running in the study and the same command continues."""
        self._terminate_all()
        name = signal.Signals(self.stop_signal).name
        print(f"{self.title}: stopped on {name}; run the same command to continue", file=sys.stderr)
        if name == "SIGUSR1" and os.environ.get("SLURM_JOB_ID") and (failure := requeue_slurm_job()) is not None:
            print(f"{self.title}: {failure}; submit the same command again to continue", file=sys.stderr)
        return signal_exit(self.stop_signal)

    def _start_next(self, slot: str) -> None:
        trials = self._trials()
        # This worker's, killed before it started, while it ran or before its end was recorded: taken up again.
        if mine := [t for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get(Life.WORKER) == slot]:
            trial = Trial(self.study, self._id(mine[0]))
        else:
            n, waiting = self.sweep.n_trials, any(t.state == TrialState.WAITING for t in trials)
            if sum(t.state in FINISHED for t in trials) >= n or (_taken(trials) >= n and not waiting):
                return
            trial = self.study.ask()
            trial.set_user_attr(Life.WORKER, slot)  # first of all: started again, this worker finds it
        if Life.STARTED not in trial.user_attrs and _taken(self._trials()[: trial.number]) >= self.sweep.n_trials:
            trial.set_user_attr(Life.SURPLUS, True)  # another worker asked at the same moment, for the last place
            self.study.tell(trial, state=TrialState.FAIL)
            return
        self._launch(slot, trial)

    def _launch(self, slot: str, trial: Trial) -> None:
        for key, distribution in self.space.items():
            _suggest(trial, key, distribution)  # the values it has are kept; the sampler chooses the others
        params = trial.params
        folder = trial.user_attrs.get(Life.FOLDER, "" if FOLD in params else f"trial-{trial.number:04d}")
        trial.set_user_attr(Life.FOLDER, folder)  # a retried trial keeps its folder
        trial.set_user_attr(Life.HEARTBEAT, time.time())
        folds = [params[FOLD]] if FOLD in params else list(range(self.folds)) or [None]
        scores = trial.user_attrs.get(Life.FOLD_SCORES, [])
        if len(scores) == len(folds):  # killed after its last fold was scored, before its value was told
            self.study.tell(trial, statistics.fmean(scores))
            return self._progress(self._trials()[trial.number])
        fold = folds[len(scores)]  # the first without a score
        run, values = folder, params
        if fold is not None:
            run, values = posixpath.join(folder, f"fold-{fold}"), {**params, FOLD: fold}
            (self.folder / folder).mkdir(exist_ok=True)
        config = trial_config(self.configs.complete(values, f"trial {trial.number}: "), self.sweep, run)
        path = self.folder / f"{run}.yaml"
        atomic_write(path, lambda f: f.write(yaml.safe_dump(config, sort_keys=False).encode()))
        env = {**self.env, **({"CUDA_VISIBLE_DEVICES": self.gpus[slot]} if slot in self.gpus else {})}
        what = "continues" if Life.STARTED in trial.user_attrs and (self.folder / run).is_dir() else "starts"
        trial.set_user_attr(Life.STARTED, time.time())  # before the process: a trial that may have run is no surplus
        fit = (["fit", "--config", str(path)], env, str(self.folder / f"{run}.log"))
        # Daemonic: when the driver exits, it stops the trial (SIGTERM: a checkpoint first) and waits for it.
        process = self.starts.Process(target=become_fit, args=fit, daemon=True)
        process.start()
        reported = set(self._trials()[trial.number].intermediate_values)  # a continued trial's reports stay
        self.running[slot] = Running(trial, run, fold, process, reported)
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
        print(f"{self.title}: {who(trial)} {what} in {self.folder / run} ({shown})", flush=True)

    def _poll(self, slot: str) -> None:
        running = self.running[slot]
        code = running.process.exitcode  # before the reports: a process that ended has written all of its own
        self._read_reports(running)
        if time.monotonic() - running.heartbeat > self.sweep.heartbeat:
            running.trial.set_user_attr(Life.HEARTBEAT, time.time())
            running.heartbeat = time.monotonic()
        if code is None:
            return
        del self.running[slot]
        if self.stop_signal is None or running.ending is not None:  # else still running in the study, continued
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
                return self._end(running, Status.FAILED, f"{self.sweep.objective} is {value} at step {step}")
            if step in running.reported or (running.fold is not None and FOLD not in running.trial.params):
                continue  # a trial of folds reports after each fold; a cv's fold at each validation
            running.reported.add(step)
            running.trial.report(value, step)
            if self.sweep.pruner != "none" and running.trial.should_prune():
                return self._end(running, Status.PRUNED)

    def _end(self, running: Running, ending: Status, reason: str = "") -> None:
        """Stop the trial between two steps, pruned or failed: its SIGTERM handler writes a checkpoint first."""
        running.ending, running.reason = ending, reason
        running.process.terminate()

    def _record(self, running: Running, code: int) -> None:
        """Tell the study how the trial's process ended: with its best value, pruned or failed; a trial of folds goes
        on with its next fold unless it was its last or the pruner stops it here."""
        trial = running.trial
        seconds = time.monotonic() - running.started + trial.user_attrs.get(Life.SECONDS, 0)
        trial.set_user_attr(Life.SECONDS, round(seconds, 1))
        trial.set_user_attr(Life.ENDED, time.time())
        value = None
        if running.ending is None and code == 0 and running.values:
            value = (max if self.sweep.direction == "maximize" else min)(running.values.values())
            value = self._fold_ended(running, value) if running.fold is not None else value
            if value is None and running.ending is None:
                return  # still running in the study, this worker's: _start_next runs its next fold
        if running.ending == Status.PRUNED:
            self._pruned(running)
        elif value is not None:
            self.study.tell(trial, value)
        else:
            self._failed(running, code)
        self.failures_in_a_row = self.failures_in_a_row + 1 if value is None and running.ending != Status.PRUNED else 0
        self._progress(self._trials()[trial.number])

    def _pruned(self, running: Running) -> None:
        self.study.tell(running.trial, state=TrialState.PRUNED)
        # Its record says so, not "interrupted" by the SIGTERM that stopped it.
        starts = read_starts(self.folder / running.folder)
        if starts and starts[-1].get("status") == Status.INTERRUPTED:
            write_starts(self.folder / running.folder, [*starts[:-1], {**starts[-1], "status": Status.PRUNED}])

    def _failed(self, running: Running, code: int) -> None:
        log = self.folder / f"{running.folder}.log"
        reason = running.reason or (_reason(log, code) if code else "no validation ran")
        running.trial.set_user_attr(Life.REASON, reason)
        self.study.tell(running.trial, state=TrialState.FAIL)
        if NOT_LOGGED in reason:
            self._terminate_all()
            raise ConfigError(reason.removeprefix("error: "))

    def _fold_ended(self, running: Running, best: float) -> float | None:
        """Record the fold's best value, report the running mean at step k; the mean once the last fold ended, else
        None: the next fold runs unless the pruner stops the trial here."""
        trial = running.trial
        scores = [*trial.user_attrs.get(Life.FOLD_SCORES, []), best]
        # The report first: killed between the two writes, the fold runs again and its report is there.
        if len(scores) - 1 not in running.reported and FOLD not in trial.params:
            trial.report(statistics.fmean(scores), len(scores) - 1)
        trial.set_user_attr(Life.FOLD_SCORES, scores)
        if FOLD in trial.params or len(scores) == self.folds:
            return statistics.fmean(scores)
        if self.sweep.pruner != "none" and trial.should_prune():
            running.ending = Status.PRUNED
        return None

    def _retry_stale(self) -> None:
        """Trials of a worker that died elsewhere (silent heartbeat) are failed and queued again, in their folder.
        Optuna's (RDBStorage's heartbeat) never fails a trial killed as Optuna created it; the journal has none."""
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            beat = t.user_attrs.get(Life.HEARTBEAT) or t.datetime_start.timestamp()  # killed as Optuna created it
            alive = time.time() - beat < STALE_HEARTBEATS * self.sweep.heartbeat
            if alive or t.user_attrs.get(Life.WORKER) in self.slots:
                continue  # alive, or ours: continued by _start_next
            try:  # the reason first: Optuna refuses to change a finished trial
                worker = t.user_attrs.get(Life.WORKER, "that asked for it")
                self.storage.set_trial_user_attr(self._id(t), Life.REASON, f"worker {worker} stopped")
                self.storage.set_trial_state_values(self._id(t), state=TrialState.FAIL)
            except (RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
                continue  # another worker failed it first
            if t.params:  # else it never started: the next trial asked replaces it
                kept = {k: t.user_attrs[k] for k in (Life.FOLDER, Life.FOLD_SCORES) if k in t.user_attrs}  # ended folds
                self.study.enqueue_trial(t.params, user_attrs={**kept, Life.RETRY_OF: t.number}, skip_if_exists=False)

    def _trials(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False)

    def _id(self, trial: FrozenTrial) -> int:
        study_id = self.storage.get_study_id_from_name(self.sweep.name)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)

    def _progress(self, trial: FrozenTrial) -> None:
        objective = self.sweep.objective
        score = f"{objective}={trial.value:.6g}" if trial.value is not None else trial.user_attrs.get(Life.REASON, "")
        best, scored = "", [t.value for t in self._trials() if t.state == TrialState.COMPLETE]
        if FOLD in trial.params and scored:  # a cv's folds are no search: their mean so far
            best = f"; mean {objective}={statistics.fmean(scored):.6g} over {len(scored)} folds"
        elif scored:
            best = f"; best {objective}={self.study.best_value:.6g} ({who(self.study.best_trial)})"
        done, state = sum(t.state in FINISHED for t in self._trials()), trial.state.name.lower()
        print(f"{self.title}: {done}/{self.sweep.n_trials} finished; {who(trial)} {state} ({score}){best}", flush=True)

    def _terminate_all(self) -> None:
        """Stop every trial between two steps (a checkpoint first) and wait for it; they stay running in the study,
        the worker's, which the same command continues."""
        for running in self.running.values():
            running.process.terminate()
        for running in self.running.values():
            running.process.join(timeout=600)


def become_fit(args: list[str], env: dict[str, str], log: str) -> None:
    """In a trial's new process: run ``python -m <package> *args`` as a fresh interpreter would, with the environment
    ``env``, its output appended to ``log``; and stop (SIGTERM) when the driver is gone, even SIGKILLed."""
    package = __package__.split(".")[0]
    os.environ.clear()
    os.environ.update(env)
    sys.argv, sys.orig_argv = [sys.argv[0], *args], [sys.executable, "-m", package, *args]
    with open(log, "ab") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    torch.seed()  # the generators drawn anew, as a fresh interpreter's are (Python's random module redraws at a fork)
    numpy.random.seed()
    multiprocessing.current_process().daemon = False  # its own processes: data loader workers, DDP ranks
    threading.Thread(target=_stop_with_driver, daemon=True).start()
    try:
        runpy.run_module(package, run_name="__main__", alter_sys=True)
    except Exception:
        sys.excepthook(*sys.exc_info())  # the traceback as the interpreter prints it, without multiprocessing's header
        sys.exit(1)
    finally:
        internals.run_exit_handlers()  # multiprocessing ends the process without them


def _stop_with_driver() -> None:
    multiprocessing.parent_process().join()  # returns when the driver is gone: its end of a pipe closes
    os.kill(os.getpid(), signal.SIGTERM)


def _taken(trials: list[FrozenTrial]) -> int:
    """The trials that take one of the ``n_trials`` places: finished, running or queued."""
    return sum(t.state != TrialState.FAIL for t in trials)


def who(trial: Trial | FrozenTrial) -> str:
    """The trial as the console names it: a cv's by its fold."""
    return f"fold {trial.params[FOLD]}" if FOLD in trial.params else f"trial {trial.number}"


def trial_config(config: dict[str, Any], sweep: Sweep, run: str) -> dict[str, Any]:
    """``config`` as a trial runs it: in its run folder, reporting the objective, its trackers grouped by sweep."""
    config.setdefault("run", {})["name"] = f"{sweep.name}/{run}"
    trainer = config.setdefault("trainer", {})
    callbacks = trainer.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    trainer["callbacks"] = [*callbacks, {"class_path": REPORTER, "init_args": {"monitor": sweep.objective}}]
    for tracker in config.get("trackers") or []:
        if names := GROUPED.get(str(tracker.get("class_path", "")).rsplit(".", 1)[-1]):
            tracker.setdefault("init_args", {}).update(zip(names, (sweep.name, run), strict=True))
    return config


def claim_slots(folder: Path, workers: int) -> dict[str, Lock]:
    """Worker ids ``<host>.<n>`` for this process, each with its lock (the kernel frees a dead process's): a trial
    records its worker, and started again, the same worker continues it at once."""
    (folder / "workers").mkdir(parents=True, exist_ok=True)
    array = os.environ.get("SLURM_ARRAY_JOB_ID")  # a requeued array task may land on another node: it keeps its id
    host = f"slurm-{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}" if array else socket.gethostname()
    host, slots, n = host.split(".")[0] or "host", {}, 0
    while len(slots) < workers:
        if (lock := try_lock(folder / "workers" / f"{host}.{n}.lock")) is not None:
            slots[f"{host}.{n}"] = lock
        n += 1
    return slots


def slot_gpus(
    trainer: Mapping[str, Any], slots: list[str], per_gpu: int = 1, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for each worker slot: slot ``<host>.<n>`` gets group ``n // per_gpu`` of the visible
    GPUs (numbered over the machine's workers, so two sweep commands get different ones); none for a CPU config."""
    cpu = str(trainer.get("accelerator", "auto")).lower() == "cpu"
    if cpu or isinstance(trainer.get("devices"), list):  # a list: the user's own GPUs, the same for every trial
        return {}
    count = gpu_count(trainer.get("devices", "auto")) or None
    available = torch.cuda.device_count()  # NVML-based: creates no CUDA context
    if count is None or available == 0:
        if available and len(slots) > 1:
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
        if len(visible) < first + count:
            raise ConfigError(
                f"worker slot {n} needs GPUs {first}..{first + count - 1} ({count} per trial from trainer.devices, "
                f"sweep.trials_per_gpu={per_gpu}) but {len(visible)} are visible; lower sweep.workers or "
                "trainer.devices, or raise sweep.trials_per_gpu"
            )
        groups[slot] = ",".join(visible[first : first + count])
    return groups


def _suggest(trial: Trial, key: str, d: BaseDistribution) -> Any:
    if isinstance(d, CategoricalDistribution):
        return trial.suggest_categorical(key, d.choices)
    suggest = trial.suggest_int if isinstance(d, IntDistribution) else trial.suggest_float
    return suggest(key, d.low, d.high, step=d.step, log=d.log)


def _reason(log: Path, code: int) -> str:
    """The one line that says why a trial process failed: its ``error:`` line, else the root exception's line."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [line.rstrip() for line in text[max(text.rfind("\nRun "), 0) :].splitlines()]  # its last start's
    for line in reversed(lines):
        if line.startswith("error:"):  # its traceback is in its log, not in the sweep's table
            return line.replace("its traceback follows", f"its traceback is in {log.name}")[:300]
    for line in lines:  # Python prints a chain of exceptions root cause first
        if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b(: |$)", line):
            return line[:300]
    return f"exit code {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")
