"""``sweep`` (an Optuna search whose trials are ``fit`` processes) and ``cv`` (k-fold cross-validation, a study whose
trials are the folds); ``fold_indices``. ``study`` runs either with ``options``, ``sampler`` and ``driver`` (whose
trials run ``reporter``). Uses ``commands`` and every package below it. This module, the commands' sections and their
``--help``, imports neither torch nor Lightning."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

from jsonargparse import ArgumentParser
from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt, restricted_number_type

from template.engine.commands import PROGRAM
from template.engine.errors import SWEEP_EXTRA, ConfigError

# What every trial imports, once in the fork server the trials start from (driver.py); a package that is not installed
# is left out. Lightning's file checks import s3fs wherever it is installed.
PRELOAD = [f"{__name__}.driver", "torch.utils.tensorboard", "s3fs"]
Fraction = restricted_number_type("Fraction", float, [(">", 0), ("<=", 1)])
Folds = restricted_number_type("Folds", int, (">=", 2))


@dataclass
class Sweep:
    """The ``sweep`` section: a hyper-parameter search whose trials are ``fit`` runs of the rest of the config.

    Args:
        name: the study, and its folder ``lightning_logs/<name>/``.
        space: option -> ``{type: float|int, low, high, log, step}`` or ``{type: categorical, choices}``.
        n_trials: trials that finish (complete or pruned); failed ones are replaced.
        workers: trials at once in this process.
        trials_per_gpu: trials that share each GPU (worker slots in a row get the same GPUs); 1 gives each its own.
        gpu_memory_fraction: the share of its GPUs' memory one trial may allocate, so it cannot starve the others.
        storage: null for a journal file in the sweep folder, an Optuna database URL (``postgresql://...``) or the
            path of a journal file on a shared disk.
        objective: the metric a trial scores (its best value); default ``checkpoint.monitor``, which it leaves as it is.
        direction: minimize or maximize the objective; default from ``checkpoint.mode`` where the objective is the
            monitor's.
        sampler: Optuna's TPE or random sampler.
        seed: the proposals are a function of the seed and the trial number; null for fresh ones each start.
        pruner: Optuna's median or hyperband pruner on the value at each validation, or none.
        n_startup_trials: trials that finish before the median pruner stops any.
        n_warmup_steps: training steps a trial runs before the median pruner may stop it (a validation reports at
            the trainer's global step; a trial of folds reports after each fold, at 0, 1, ...).
        max_failures: failed trials in a row that stop the sweep.
        heartbeat: seconds between a trial's heartbeats; one silent for 4 (its worker died) is continued by another.
        enqueue: values to try first (option -> value, as in ``space``), e.g. a known good configuration.
    """

    name: str
    space: dict[str, Any]
    n_trials: PositiveInt = 20
    workers: PositiveInt = 1
    trials_per_gpu: PositiveInt = 1
    gpu_memory_fraction: Fraction | None = None
    storage: str | None = None
    objective: str | None = None
    direction: Literal["minimize", "maximize"] | None = None
    sampler: Literal["tpe", "random"] = "tpe"
    seed: int | None = 0
    pruner: Literal["median", "hyperband", "none"] = "median"
    n_startup_trials: NonNegativeInt = 5
    n_warmup_steps: NonNegativeInt = 0
    max_failures: PositiveInt = 3
    heartbeat: PositiveFloat = 30.0
    enqueue: list[dict[str, Any]] | None = None


@dataclass
class CrossValidation:
    """The ``cv`` section: k-fold cross-validation of the rest of the config, each fold a ``fit`` run.

    Args:
        folds: the number of folds; each trains on the others and validates on its own.
        name: its folder ``lightning_logs/<name>/``; default: the configs' names and a hash of the complete config.
        workers: folds at once in this process.
        storage: as ``sweep.storage``: null for a journal file in the folder, a database URL or a journal path.
        objective: the metric each fold scores (its best value); default ``checkpoint.monitor``.
        direction: as ``sweep.direction``: which of the fold's values is its best.
        stratify: refuse a DataModule that gives the split no labels (folds are stratified whenever it gives them).
    """

    folds: Folds = 5
    name: str | None = None
    workers: PositiveInt = 1
    storage: str | None = None
    objective: str | None = None
    direction: Literal["minimize", "maximize"] | None = None
    stratify: bool = False


@dataclass
class TrialFolds:
    """The ``cv`` section of a ``sweep``: each trial a cross-validation, its value the mean over its folds.

    Args:
        folds: each trial's folds, run one after another, the pruner deciding after each on the running mean;
            null: each trial is one fit on the DataModule's own split.
        stratify: as ``cv.stratify``.
    """

    folds: Folds | None = None
    stratify: bool = False


SWEEP = {"sweep": Sweep, "cv": TrialFolds}
CV = {"cv": CrossValidation}


def main(argv: list[str], command: str = "sweep") -> int:
    """Run or continue the sweep (or the cross-validation, ``cv``) the arguments describe; the exit code."""
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError(f"the {command} needs Optuna; {SWEEP_EXTRA}")
    if "-h" in argv or "--help" in argv:
        print_help(command)
        return 0
    start_fork_server()  # it imports torch and Lightning while this process does (the driver says if it cannot)
    from template.engine.sweep.study import run

    return run(argv, command)


def cv_main(argv: list[str]) -> int:
    return main(argv, "cv")


def start_fork_server() -> str | None:
    """Start the fork server the trials start from, in the trials' environment (which the modules read as they are
    imported), unless it runs; None, or why the trials start fresh interpreters instead."""
    if sys.platform != "linux":  # macOS's system libraries may start threads, which a fork without exec breaks
        return f"no fork server on {sys.platform}"
    import multiprocessing.forkserver
    from unittest import mock

    multiprocessing.set_forkserver_preload(PRELOAD)
    try:
        with mock.patch.dict(os.environ, trial_environment(), clear=True):
            multiprocessing.forkserver.ensure_running()
    except OSError as err:  # its socket goes in TMPDIR, too long over ~70 characters (before CPython gh-132124)
        return f"the fork server cannot start: {err}; a shorter TMPDIR lets it"
    return None


def trial_environment() -> dict[str, str]:
    """This process's environment as a trial gets it: without SLURM's variables (the trial is no SLURM task)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def print_help(command: str) -> None:
    """The options of ``sweep`` or ``cv``; every other one is fit's."""
    parser = ArgumentParser(prog=f"{PROGRAM} {command}", default_config_files=[])
    for name, options in (CV if command == "cv" else {"sweep": Sweep}).items():
        parser.add_class_arguments(options, name)
    parser.print_help()
    if command == "sweep":
        print("\n--cv.folds=k (or a cv: section): each trial a k-fold cross-validation, scored by the mean")
    print(f"\nEvery other option is fit's: {PROGRAM} fit --help")
