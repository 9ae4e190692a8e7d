#!/usr/bin/env python
"""Learning curves of one run: loss and accuracy per epoch, train against validation, from its metrics.csv.

python scripts/plot_metrics.py lightning_logs/version_0                 # writes .../learning_curves.png
python scripts/plot_metrics.py lightning_logs/version_0/metrics.csv --out curves.png
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import NoReturn

# Per-epoch columns the project's Classifier logs, and where each curve comes from.
CURVES = {
    "loss": {"train": "train_loss_epoch", "val": "val_loss"},
    "accuracy": {"train": "train_acc", "val": "val_acc"},
}
# Older runs logged the training loss per step only: its mean over each epoch stands in for the epoch value.
STEP_FALLBACK = {"train_loss_epoch": "train_loss"}


class PlotError(Exception):
    """A problem with the input that the user can fix; reported as one line."""


def read_metrics(path: Path) -> list[dict[str, str]]:
    """The rows of a CSVLogger ``metrics.csv`` (a run folder or the file itself)."""
    csv_path = path / "metrics.csv" if path.is_dir() else path
    if not csv_path.is_file():
        raise PlotError(f"no metrics file at '{csv_path}'; pass a run folder such as lightning_logs/version_0")
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "epoch" not in rows[0]:
        raise PlotError(f"'{csv_path}' has no 'epoch' column; is it a metrics.csv written by Lightning's CSVLogger?")
    return rows


def per_epoch(rows: list[dict[str, str]], column: str) -> dict[int, float]:
    """{epoch: value} of one column: the epoch's value, or the mean of its step values for a step-level column."""
    values: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        if row.get(column) not in (None, ""):
            values[int(float(row["epoch"]))].append(float(row[column]))
    return {epoch: statistics.fmean(v) for epoch, v in sorted(values.items())}


def curves(rows: list[dict[str, str]]) -> dict[str, dict[str, dict[int, float]]]:
    """{"loss"|"accuracy": {"train"|"val": {epoch: value}}}, leaving out curves the run did not log."""
    result: dict[str, dict[str, dict[int, float]]] = {}
    for panel, sources in CURVES.items():
        for split, column in sources.items():
            points = per_epoch(rows, column) or per_epoch(rows, STEP_FALLBACK.get(column, column))
            if points:
                result.setdefault(panel, {})[split] = points
    if not result:
        columns = ", ".join(rows[0])
        raise PlotError(
            f"none of the per-epoch metrics ({', '.join(c for s in CURVES.values() for c in s.values())}) "
            f"is in the file (it has: {columns})"
        )
    return result


def plot(data: dict[str, dict[str, dict[int, float]]], out: Path, title: str) -> None:
    """Write one PNG with a loss panel and an accuracy panel, train and validation in each."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(
            'the plot needs matplotlib; install it with `pip install matplotlib` or `pip install -e ".[dev]"`'
        ) from None
    figure, axes = plt.subplots(1, len(data), figsize=(5.2 * len(data), 4), squeeze=False)
    for ax, (panel, splits) in zip(axes[0], data.items(), strict=True):
        for split, points in splits.items():
            ax.plot(list(points), list(points.values()), marker="o", markersize=3, label=split)
        ax.set(title=panel, xlabel="epoch", ylabel=panel)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend()
    figure.suptitle(title)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


class OneLineErrors(argparse.ArgumentParser):
    """Reports a bad option as one ``error:`` line and exit status 2, without the usage text."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}; see --help", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """Read a run's metrics.csv and write its learning curves."""
    parser = OneLineErrors(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run folder (lightning_logs/version_N) or its metrics.csv")
    parser.add_argument("--out", type=Path, help="PNG to write (default: learning_curves.png next to metrics.csv)")
    args = parser.parse_args(argv)
    try:
        rows = read_metrics(args.run)
        run_dir = args.run if args.run.is_dir() else args.run.parent
        out = args.out or run_dir / "learning_curves.png"
        if out.suffix.lower() != ".png":
            raise PlotError(f"--out '{out}' is not a .png file name; pass e.g. --out curves.png")
        plot(curves(rows), out, title=str(run_dir))
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
