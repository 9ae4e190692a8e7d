"""What a finished study leaves in its folder: its table (terminal and CSV), then a sweep's ``best.yaml`` and
Optuna's plots, or a cv's ``folds.md`` and the folds' validation curves."""

from __future__ import annotations

import csv
import io
import json
import statistics
import warnings
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from template.engine.runs.table import format_table
from template.engine.store import atomic_write
from template.engine.sweep.driver import FOLD_SCORES, who
from template.engine.sweep.folds import FOLD
from template.engine.sweep.reporter import REPORTER, REPORTS

TABLE, FOLDS, BEST = "trials.csv", "folds.csv", "best.yaml"


def write_results(study: optuna.Study, folder: Path, objective: str, cv: bool = False) -> None:
    """The table of a sweep's trials (with ``cv.folds``: each trial's mean, each fold's best and their standard
    deviation, as scikit-learn's ``cv_results_``), or of a cv's folds (each fold's best objective and the metrics
    logged with it, their mean and standard deviation), printed and written with the rest."""
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]
    header, rows = (_folds if cv else _trials)(trials, folder, objective)
    text = io.StringIO(newline="")
    csv.writer(text).writerows([header, *rows])
    atomic_write(folder / (FOLDS if cv else TABLE), lambda f: f.write(text.getvalue().encode()))
    cells = [[f"{v:.6g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    print(format_table(header, cells))
    if cv:
        lines = ["| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *cells]]
        atomic_write(folder / "folds.md", lambda f: f.write("\n".join([*lines, ""]).encode()))
        plotted = _curves(trials, folder, objective)
        print(f"Table: {folder / FOLDS}, folds.md" + (", plot: curves.png" if plotted else ""))
        print(f"CV {study.study_name}: {objective} {rows[-2][1]:.6g} +- {rows[-1][1]:.3g} over {len(rows) - 2} folds")
        return
    print(f"Table: {folder / TABLE}")
    if any(t.state == TrialState.COMPLETE for t in trials):
        best = study.best_trial
        run = best.user_attrs["folder"] + ("/fold-0" if FOLD_SCORES in best.user_attrs else "")
        text_best = yaml.safe_dump(reproduction(yaml.safe_load((folder / f"{run}.yaml").read_text())), sort_keys=False)
        atomic_write(folder / BEST, lambda f: f.write(text_best.encode()))
        print(f"Best: trial {best.number}, {objective}={best.value:.6g}; reproduce it with")
        print(f"  python -m {__package__.split('.')[0]} fit --config {folder / BEST}")
    for name in _plots(study, folder):
        print(f"Plot: {folder / name}")


def _trials(trials: list[FrozenTrial], folder: Path, objective: str) -> tuple[list[str], list[list[Any]]]:
    keys = sorted({k for t in trials for k in t.params})
    folds = max((len(t.user_attrs.get(FOLD_SCORES, [])) for t in trials), default=0)
    header = ["trial", *keys, objective, *(f"fold {k}" for k in range(folds)), *(["std"] if folds else [])]
    rows = []
    for t in trials:
        scores = t.user_attrs.get(FOLD_SCORES, [])
        std = [statistics.stdev(scores) if len(scores) == folds else ""] if folds else []
        rows.append(
            [t.number, *(t.params.get(k, "") for k in keys), "" if t.value is None else t.value]
            + [*scores, *[""] * (folds - len(scores)), *std]
            + [t.state.name.lower(), t.user_attrs.get("seconds", ""), str(folder / t.user_attrs.get("folder", ""))]
            + [t.user_attrs.get("reason", "")]
        )
    return [*header, "state", "seconds", "folder", "reason"], rows


def _folds(trials: list[FrozenTrial], folder: Path, objective: str) -> tuple[list[str], list[list[Any]]]:
    done = sorted((t.params[FOLD], t) for t in trials if t.state == TrialState.COMPLETE)
    best = {k: _best_row(folder / f"fold-{k}", objective, t.value) for k, t in done}
    keys = [objective, *sorted({key for row in best.values() for key in row} - {objective})]
    rows: list[list[Any]] = [[k, *(row.get(key, "") for key in keys)] for k, row in best.items()]
    for what, stat in (("mean", statistics.mean), ("std", statistics.stdev)):
        columns = [[row[key] for row in best.values() if key in row] for key in keys]
        rows.append([what, *(stat(c) if len(c) == len(best) else "" for c in columns)])
    return ["fold", *keys], rows


def _best_row(run: Path, objective: str, best: float) -> dict[str, float]:
    """The metrics a fold logged at the validation where its objective was best (its ``metrics.csv`` row)."""
    with (run / "metrics.csv").open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get(objective)]
    row = min(rows, key=lambda r: abs(float(r[objective]) - best), default={})
    values = {key: float(value) for key, value in row.items() if value and key not in ("epoch", "step")}
    return {**values, objective: best}  # the objective as the study scored it, the others from the same validation


def reproduction(config: dict[str, Any]) -> dict[str, Any]:
    """A trial's config as a plain fit: no reporter, a new run folder of its own, the DataModule's own split."""
    config.get("run", {})["name"] = None
    data = config.get("data", {}).get("init_args") or {}
    if "fold" in data:
        data["fold"] = None
    trainer = config.get("trainer", {})
    trainer["callbacks"] = [c for c in trainer.get("callbacks") or [] if c.get("class_path") != REPORTER] or None
    return config


def _curves(trials: list[FrozenTrial], folder: Path, objective: str) -> bool:
    """The objective at each validation of each fold, in ``curves.png``; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(figsize=(7, 4))
    for trial in sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.params[FOLD]):
        # A fold restarted from a checkpoint repeats some validations: the last one counts.
        reports = (folder / f"fold-{trial.params[FOLD]}" / REPORTS).read_text().splitlines()
        points = sorted({r["step"]: r["value"] for r in map(json.loads, reports)}.items())
        axes.plot(*zip(*points, strict=True), marker=".", label=who(trial))
    axes.set(xlabel="step", ylabel=objective, title=f"{folder.name}: {objective} at each validation")
    axes.legend()
    _save_png(figure, folder / "curves.png")
    return True


def _plots(study: optuna.Study, folder: Path) -> list[str]:
    """Optuna's matplotlib plots; each needs enough complete trials (importances: two parameters or more)."""
    if _pyplot() is None:
        return []
    from optuna.visualization import matplotlib as plots

    written = []
    for name, plot in (
        ("history.png", plots.plot_optimization_history),
        ("importances.png", plots.plot_param_importances),
        ("parallel_coordinates.png", plots.plot_parallel_coordinate),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            try:
                axes = plot(study)
            except (ValueError, RuntimeError, ZeroDivisionError):
                continue  # too few complete trials for this plot
        _save_png(getattr(axes, "figure", None) or axes.flat[0].figure, folder / name)
        written.append(name)
    return written


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files; None without the extra, said in one line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("Plots need matplotlib: pip install -e '.[sweep]'")
        return None
    return plt


def _save_png(figure: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    atomic_write(path, lambda f: f.write(buffer.getvalue()))
