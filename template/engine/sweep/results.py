"""What a finished sweep leaves: the table (terminal and CSV), ``best.yaml`` and Optuna's plots."""

from __future__ import annotations

import csv
import io
import statistics
import warnings
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

from template.engine.store import atomic_write
from template.engine.sweep.driver import FOLD_SCORES
from template.engine.sweep.fitconfig import reproduction

TABLE = "trials.csv"
BEST = "best.yaml"


def write_results(study: optuna.Study, folder: Path, objective: str) -> None:
    """Print the table of trials and write it, ``best.yaml`` and the PNG plots into the sweep folder.

    With ``cv.folds`` the objective is each trial's mean over its folds, followed by each fold's and their standard
    deviation (n - 1), as scikit-learn's ``cv_results_`` lists them."""
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]
    keys = sorted({k for t in trials for k in t.params})
    folds = max((len(t.user_attrs.get(FOLD_SCORES, [])) for t in trials), default=0)
    scores = [f"fold {k}" for k in range(folds)] + (["std"] if folds else [])
    header = ["trial", *keys, objective, *scores, "state", "seconds", "folder", "reason"]
    rows = [
        [
            t.number,
            *(t.params.get(k, "") for k in keys),
            "" if t.value is None else t.value,
            *_fold_scores(t.user_attrs.get(FOLD_SCORES, []), folds),
            t.state.name.lower(),
            t.user_attrs.get("seconds", ""),
            str(folder / t.user_attrs.get("folder", "")),
            t.user_attrs.get("reason", ""),
        ]
        for t in trials
    ]
    write_csv(folder / TABLE, header, rows)
    print(format_table(header, rows))
    print(f"Table: {folder / TABLE}")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        run = best.user_attrs["folder"] + ("/fold-0" if folds else "")  # reproduced without folds
        config = yaml.safe_load((folder / f"{run}.yaml").read_text())
        text_best = yaml.safe_dump(reproduction(config), sort_keys=False)
        atomic_write(folder / BEST, lambda f: f.write(text_best.encode()))
        print(f"Best: trial {best.number}, {objective}={best.value:.6g}; reproduce it with")
        print(f"  python -m {__package__.split('.')[0]} fit --config {folder / BEST}")
    for name in _plots(study, folder):
        print(f"Plot: {folder / name}")


def _fold_scores(scores: list[float], folds: int) -> list[Any]:
    """A trial's fold columns: its folds' best values (a pruned trial's first ones), their std once all ran."""
    if not folds:
        return []
    return [*scores, *[""] * (folds - len(scores)), statistics.stdev(scores) if len(scores) == folds else ""]


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    text = io.StringIO(newline="")
    csv.writer(text).writerows([header, *rows])
    atomic_write(path, lambda f: f.write(text.getvalue().encode()))


def cell(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    table = [header, *([cell(v) for v in row] for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table)


def _plots(study: optuna.Study, folder: Path) -> list[str]:
    """Optuna's matplotlib plots; each needs enough complete trials (importances: two parameters or more)."""
    if pyplot() is None:
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
        save_png(getattr(axes, "figure", None) or axes.flat[0].figure, folder / name)
        written.append(name)
    return written


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files; None without the extra, said in one line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("Plots need matplotlib: pip install -e '.[sweep]'")
        return None
    return plt


def save_png(figure: Any, path: Path) -> None:
    """A matplotlib figure written crash-safe as a PNG, and closed."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    atomic_write(path, lambda f: f.write(buffer.getvalue()))
