"""``python -m template cv --config ... --cv.folds=5``: k-fold cross-validation, a study whose trials are the folds.

Each fold is a trial with a fixed ``data.fold``, run by the sweep's driver as a ``fit`` in ``<name>/fold-<k>/``: the
folds get the sweep's restarts, workers, SLURM arrays and shared storages as they are.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import inspect
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningDataModule
from optuna.trial import TrialState

from template.engine import config_files, folds
from template.engine.atomic import atomic_write
from template.engine.errors import ConfigError, config_error_in
from template.engine.sweep.driver import Driver
from template.engine.sweep.fitconfig import FitConfigs
from template.engine.sweep.options import Command, Sweep, check, parse_section
from template.engine.sweep.reporter import REPORTS
from template.engine.sweep.results import format_table
from template.engine.sweep.study import run_study

FOLD = "data.fold"


@dataclass
class CrossValidation:
    """The ``cv`` section: k-fold cross-validation of the rest of the config, each fold a ``fit`` run.

    Args:
        folds: the number of folds; each trains on the others and validates on its own.
        name: the cross-validation and its folder ``lightning_logs/<name>/``; default from the configs' names and a
            hash of the complete config, so the same command continues it and another config starts a new one.
        workers: folds at once in this process.
        storage: as ``sweep.storage``: null for a journal file in the folder, a database URL or a journal path.
        objective: the metric each fold scores (its best value); default ``checkpoint.monitor``.
        stratify: require folds stratified by label: a DataModule that gives the split no labels is refused (folds
            are stratified whenever it gives them).
        heartbeat: as ``sweep.heartbeat``.
    """

    folds: int = 5
    name: str | None = None
    workers: int = 1
    storage: str | None = None
    objective: str | None = None
    stratify: bool = False
    heartbeat: float = 30.0


class FoldDriver(Driver):
    """The sweep's driver, each trial in the folder of its fold."""

    label = "CV"

    def trial_folder(self, trial: optuna.trial.Trial) -> str:
        return f"fold-{trial.params[FOLD]}"


def run_cv(argv: list[str]) -> int:
    """Check everything, then run (or continue) the cross-validation; the exit code."""
    cv, fit_args = parse_section(argv, "cv", CrossValidation)
    if cv.folds < 2:
        raise ConfigError(f"cv.folds={cv.folds}: cross-validation needs at least 2 folds, e.g. --cv.folds=5")
    configs = FitConfigs(fit_args)
    data = configs.complete({})["data"]
    if not {"fold", "num_folds"} <= set(inspect.signature(_class(data["class_path"])).parameters):
        raise ConfigError(
            f"{data['class_path']} cannot be cross-validated: its __init__ needs the arguments ({folds.PROTOCOL}) "
            "and a split by template.engine.folds.fold_indices (see docs/cv.md)"
        )
    configs.fit_args.append(f"--data.num_folds={cv.folds}")
    base = configs.complete({})
    name = cv.name or _default_name(argv, base)
    print(f"CV {name}: {_check_split(base['data'], cv)}", flush=True)
    sweep = Sweep(
        name=name,
        space={FOLD: {"type": "categorical", "choices": list(range(cv.folds))}},
        n_trials=cv.folds,
        workers=cv.workers,
        storage=cv.storage,
        objective=cv.objective,
        sampler="random",  # a failed fold's replacement: the only value no other trial has, its fold
        pruner="none",
        max_failures=1,  # a fold fails again the same way: stop, the same command continues once it is fixed
        heartbeat=cv.heartbeat,
        enqueue=[{FOLD: k} for k in range(cv.folds)],
    )
    return run_study(Command(sweep, check(sweep), configs.fit_args), configs, FoldDriver, write_summary)


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _default_name(argv: list[str], config: dict[str, Any]) -> str:
    stems = "-".join(Path(path).stem for path in config_files.split(argv)[0]) or "cv"
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{stems}-cv{config['data']['init_args']['num_folds']}-{digest}"


def _check_split(data: dict[str, Any], cv: CrossValidation) -> str:
    """Fold 0's DataModule, prepared and set up here before any fold starts: its split's refusals come first."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data")
    data = {**data, "init_args": {**data.get("init_args", {}), "fold": 0, "num_folds": cv.folds}}
    folds.last_split.clear()
    try:
        module = parser.instantiate_classes(parser.parse_object({"data": data})).data
        module.prepare_data()
        module.setup("fit")
    except Exception as err:
        if (cause := config_error_in(err)) is not None:
            raise ConfigError(f"cv.folds={cv.folds}: {cause}") from None
        raise
    split = dict(folds.last_split)
    if cv.stratify and not split.get("stratified"):
        raise ConfigError(
            f"cv.stratify=true, but {data['class_path']} gives fold_indices no labels; pass labels= to it, or drop "
            "cv.stratify for plain k-fold"
        )
    if not split:
        return f"{cv.folds} folds, split by {data['class_path']}"
    kind = "stratified by label" if split["stratified"] else "plain k-fold (no labels given)"
    return f"{cv.folds} folds of {split['samples']} samples, {kind}"


def write_summary(study: optuna.Study, folder: Path, objective: str) -> None:
    """Each fold's best objective and the metrics logged with it, their mean and standard deviation: the table on
    the terminal, in ``folds.csv`` and ``folds.md``; the folds' validation curves in ``curves.png``."""
    trials = {t.params[FOLD]: t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE}
    rows = {k: _best_row(folder / t.user_attrs["folder"], objective, t.value) for k, t in sorted(trials.items())}
    keys = [objective, *sorted({key for row in rows.values() for key in row} - {objective})]
    header = ["fold", *keys]
    table: list[list[Any]] = [[k, *(row.get(key, "") for key in keys)] for k, row in rows.items()]
    for what, stat in (("mean", _mean), ("std", _std)):
        columns = [[row[key] for row in rows.values() if isinstance(row.get(key), float)] for key in keys]
        table.append([what, *(stat(c) if len(c) == len(rows) else "" for c in columns)])
    text = io.StringIO(newline="")
    csv.writer(text).writerows([header, *table])
    atomic_write(folder / "folds.csv", lambda f: f.write(text.getvalue().encode()))
    cells = [[_cell(v) for v in row] for row in [header, *table]]
    markdown = "\n".join("| " + " | ".join(row) + " |" for row in [cells[0], ["---"] * len(header), *cells[1:]])
    atomic_write(folder / "folds.md", lambda f: f.write((markdown + "\n").encode()))
    print(format_table(header, table))
    print(f"Table: {folder / 'folds.csv'}, {folder / 'folds.md'}")
    if _plot_curves(trials, folder, objective):
        print(f"Plot: {folder / 'curves.png'}")
    mean, std = table[-2][1], table[-1][1]
    print(f"CV {study.study_name}: {objective} {mean:.6g} +- {std:.3g} over {len(rows)} folds", flush=True)


def _best_row(run: Path, objective: str, best: float) -> dict[str, float]:
    """The metrics a fold logged at the validation where its objective was best (its ``metrics.csv`` row)."""
    with (run / "metrics.csv").open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get(objective)]
    row = min(rows, key=lambda r: abs(float(r[objective]) - best), default={})
    values = {key: float(value) for key, value in row.items() if value and key not in ("epoch", "step")}
    return {**values, objective: best}  # the objective as the study scored it, the others from the same validation


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    """The sample standard deviation (n - 1), as pandas and torch.std give it."""
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def _cell(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _plot_curves(trials: dict[int, optuna.trial.FrozenTrial], folder: Path, objective: str) -> bool:
    """The objective at each validation, one line a fold (a restarted fold's repeated validation: the last)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("Plots need matplotlib: pip install -e '.[sweep]'")
        return False
    figure, axes = plt.subplots(figsize=(7, 4))
    for k, trial in sorted(trials.items()):
        path = folder / trial.user_attrs["folder"] / REPORTS
        lines = path.read_text().splitlines() if path.is_file() else []
        points = {r["step"]: r["value"] for r in map(json.loads, lines)}
        axes.plot(sorted(points), [points[s] for s in sorted(points)], marker=".", label=f"fold {k}")
    axes.set(xlabel="step", ylabel=objective, title=f"{folder.name}: {objective} at each validation")
    axes.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    atomic_write(folder / "curves.png", lambda f: f.write(buffer.getvalue()))
    return True
