"""What a run shows and logs: its first lines, the progress bar, CSV and TensorBoard logs, trackers, throughput. Uses
the store and errors only: the packages above announce themselves here (``console.Mechanism``). This module imports
neither torch nor Lightning: the runs table reads ``metrics.csv`` with it."""

from __future__ import annotations

import csv
import os

METRICS = "metrics.csv"  # the CSV logger's


def read_metrics(path: str | os.PathLike) -> tuple[list[dict[str, str]], str | None]:
    """The rows of a ``metrics.csv`` that can be read, without their empty cells, and its first damage in words (None
    if none): not text, a row cut by a crash, no ``step`` column or a step that is not a number."""
    rows: list[dict[str, str]] = []
    damage = None
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for number, row in enumerate(csv.DictReader(f), start=2):
                rows.append({k: v for k, v in row.items() if isinstance(k, str) and v})
                if damage is None and (None in row or None in row.values()):
                    damage = f"line {number} has {'more' if None in row else 'fewer'} cells than the header"
                elif damage is None and not str(row.get("step")).isdigit():
                    damage = f"line {number} has step {row.get('step')!r}, not a number"
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        return rows, f"not a CSV file ({err})"
    return rows, damage
