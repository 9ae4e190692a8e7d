"""``python -m template cv --config ... --cv.folds=5``: k-fold cross-validation, a study whose trials are the folds.

Each fold is a trial queued with its ``data.fold``, run by the sweep's driver as a ``fit`` in ``<name>/fold-<k>/``:
the folds get the sweep's restarts, workers, SLURM arrays and shared storages as they are. In a ``sweep``,
``--cv.folds`` makes each trial a cross-validation instead (the driver runs its folds, see ``Driver``).
"""

from __future__ import annotations

import csv
import hashlib
import inspect
import json
import pydoc
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningDataModule
from optuna.trial import TrialState

from template.engine.commands import preflight as config_files
from template.engine.errors import ConfigError, config_error_in
from template.engine.store import atomic_write
from template.engine.sweep import folds
from template.engine.sweep.driver import FOLD, Driver
from template.engine.sweep.fitconfig import FitConfigs
from template.engine.sweep.options import Command, Sweep, check, parse_command, parse_section
from template.engine.sweep.reporter import REPORTS
from template.engine.sweep.results import cell, format_table, pyplot, save_png, write_csv
from template.engine.sweep.study import run_study


@dataclass
class CrossValidation:
    """The ``cv`` section: k-fold cross-validation of the rest of the config, each fold a ``fit`` run.

    Args:
        folds: the number of folds; each trains on the others and validates on its own.
        name: its folder ``lightning_logs/<name>/``; default: the configs' names and a hash of the complete config.
        workers: folds at once in this process.
        storage: as ``sweep.storage``: null for a journal file in the folder, a database URL or a journal path.
        objective: the metric each fold scores (its best value); default ``checkpoint.monitor``.
        stratify: refuse a DataModule that gives the split no labels (folds are stratified whenever it gives them).
    """

    folds: int = 5
    name: str | None = None
    workers: int = 1
    storage: str | None = None
    objective: str | None = None
    stratify: bool = False


@dataclass
class TrialFolds:
    """The ``cv`` section of a ``sweep``: each trial a cross-validation, its value the mean over its folds.

    Args:
        folds: each trial's folds, run one after another, the pruner deciding after each on the running mean;
            null: each trial is one fit on the DataModule's own split.
        stratify: as ``cv.stratify``.
    """

    folds: int | None = None
    stratify: bool = False


class FoldDriver(Driver):
    label = "CV"

    def trial_folder(self, trial: optuna.trial.Trial) -> str:
        return f"fold-{trial.params[FOLD]}"

    def who(self, trial: optuna.trial.Trial | optuna.trial.FrozenTrial) -> str:
        return f"fold {trial.params.get(FOLD, '?')}"


def run_cv(argv: list[str]) -> int:
    """Check everything, then run (or continue) the cross-validation; the exit code."""
    cv, fit_args = parse_section(argv, "cv", CrossValidation)
    configs = FitConfigs(fit_args)
    split, base = _prepare(configs, cv.folds, cv.stratify)
    stems = "-".join(Path(path).stem for path in config_files.split(argv)[0]) or "cv"
    name = cv.name or f"{stems}-cv{cv.folds}-{hashlib.sha256(json.dumps(base).encode()).hexdigest()[:8]}"
    print(f"CV {name}: {split}", flush=True)
    sweep = Sweep(
        name=name,
        space={FOLD: {"type": "categorical", "choices": list(range(cv.folds))}},
        n_trials=cv.folds,
        workers=cv.workers,
        storage=cv.storage,
        objective=cv.objective,
        pruner="none",
        max_failures=1,  # it would fail again; the same command reruns it (the only fold value no trial has)
        enqueue=[{FOLD: k} for k in range(cv.folds)],
    )
    return run_study(Command(sweep, check(sweep), configs.fit_args), configs, FoldDriver, write_summary)


def run_sweep(argv: list[str]) -> int:
    """``sweep``, its trials each a cross-validation where ``--cv.folds`` is given; the exit code."""
    command = parse_command(argv)
    try:
        cv, command.fit_args = parse_section(command.fit_args, "cv", TrialFolds)
    except ConfigError as err:  # e.g. --cv.workers, which is sweep.workers here
        raise ConfigError(f"{str(err).split(';')[0]}; in a sweep, cv takes folds and stratify only") from None
    configs = FitConfigs(command.fit_args)
    if cv.folds is not None:
        command.folds = cv.folds
        print(f"Sweep {command.sweep.name}: each trial {_prepare(configs, cv.folds, cv.stratify)[0]}", flush=True)
    return run_study(command, configs)


def _prepare(configs: FitConfigs, k: int, stratify: bool) -> tuple[str, dict[str, Any]]:
    """Refuse what cannot be split in ``k`` folds, set the DataModule's ``num_folds``; the split in words, and the
    complete config with it."""
    if k < 2:
        raise ConfigError(f"cv.folds={k}: cross-validation needs at least 2 folds, e.g. --cv.folds=5")
    data = configs.complete({})["data"]["class_path"]
    if not {"fold", "num_folds"} <= set(inspect.signature(pydoc.locate(data)).parameters):
        raise ConfigError(
            f"{data} cannot be cross-validated: its __init__ needs the arguments ({folds.PROTOCOL}) and a split by "
            "template.engine.fold_indices (see docs/cv.md)"
        )
    configs.fit_args.append(f"--data.num_folds={k}")
    config = configs.complete({})
    return _check_split(config["data"], k, stratify), config


def _check_split(data: dict[str, Any], k: int, stratify: bool) -> str:
    """Fold 0's DataModule, prepared and set up here before any fold starts: its split's refusals come first."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data")
    data = {**data, "init_args": {**data.get("init_args", {}), "fold": 0}}
    folds.last_split.clear()
    try:
        module = parser.instantiate_classes(parser.parse_object({"data": data})).data
        module.prepare_data()
        module.setup("fit")
    except Exception as err:
        if (cause := config_error_in(err)) is not None:
            raise ConfigError(f"cv.folds={k}: {cause}") from None
        raise
    stratified = folds.last_split.get("stratified")
    if stratify and not stratified:
        raise ConfigError(
            f"cv.stratify=true, but {data['class_path']} gives fold_indices no labels; pass labels= to it, or drop "
            "cv.stratify for plain k-fold"
        )
    kind = {True: "stratified by label", False: "plain k-fold (no labels)", None: f"split by {data['class_path']}"}
    return f"{k} folds of {folds.last_split.get('samples', 'its')} samples, {kind[stratified]}"


def write_summary(study: optuna.Study, folder: Path, objective: str) -> None:
    """Each fold's best objective and the metrics logged with it, their mean and standard deviation (n - 1): the
    table on the terminal, in ``folds.csv`` and ``folds.md``; the folds' validation curves in ``curves.png``."""
    trials = {t.params[FOLD]: t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE}
    rows = {k: _best_row(folder / t.user_attrs["folder"], objective, t.value) for k, t in sorted(trials.items())}
    keys = [objective, *sorted({key for row in rows.values() for key in row} - {objective})]
    table: list[list[Any]] = [[k, *(row.get(key, "") for key in keys)] for k, row in rows.items()]
    for what, stat in (("mean", statistics.mean), ("std", statistics.stdev)):
        columns = [[row[key] for row in rows.values() if key in row] for key in keys]
        table.append([what, *(stat(c) if len(c) == len(rows) else "" for c in columns)])
    header = ["fold", *keys]
    write_csv(folder / "folds.csv", header, table)
    lines = ["| " + " | ".join(map(cell, row)) + " |" for row in [header, ["---"] * len(header), *table]]
    atomic_write(folder / "folds.md", lambda f: f.write("\n".join([*lines, ""]).encode()))
    print(format_table(header, table))
    plt = pyplot()
    if plt is not None:
        figure, axes = plt.subplots(figsize=(7, 4))
        for k, trial in sorted(trials.items()):
            # Each validation's value; a fold restarted from a checkpoint repeats some: the last one counts.
            reports = (folder / trial.user_attrs["folder"] / REPORTS).read_text().splitlines()
            points = sorted({r["step"]: r["value"] for r in map(json.loads, reports)}.items())
            axes.plot(*zip(*points, strict=True), marker=".", label=f"fold {k}")
        axes.set(xlabel="step", ylabel=objective, title=f"{folder.name}: {objective} at each validation")
        axes.legend()
        save_png(figure, folder / "curves.png")
    print(f"Table: {folder / 'folds.csv'}, folds.md" + (", plot: curves.png" if plt else ""))
    print(f"CV {study.study_name}: {objective} {table[-2][1]:.6g} +- {table[-1][1]:.3g} over {len(rows)} folds")


def _best_row(run: Path, objective: str, best: float) -> dict[str, float]:
    """The metrics a fold logged at the validation where its objective was best (its ``metrics.csv`` row)."""
    with (run / "metrics.csv").open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get(objective)]
    row = min(rows, key=lambda r: abs(float(r[objective]) - best), default={})
    values = {key: float(value) for key, value in row.items() if value and key not in ("epoch", "step")}
    return {**values, objective: best}  # the objective as the study scored it, the others from the same validation
