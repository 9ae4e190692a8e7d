"""``python -m template runs [ROOT]``: every run folder in one table, read from ``provenance.json``, ``config.yaml``
and ``metrics.csv`` alone: without torch or the user's code it answers in a moment, also where the runs' code no
longer runs."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from template.engine.runs import CHECKPOINTS, CONFIG, INTERRUPTED, LOGS, METRICS, PROVENANCE, configs, read_starts

# Keys that differ between runs without saying anything about how they differ.
_IGNORED_KEYS = {"ckpt_path", "run.name"}
HEADER = ["run", "status", "best", "epochs", "steps", "duration", "samples/s"]


def find_runs(root: Path) -> list[Path]:
    """The run folders under ``root`` (those holding one of the files any run writes), sorted; checkpoints skipped."""
    found = []
    for directory, subdirectories, files in os.walk(root):  # in order: each level's folders sorted
        subdirectories[:] = sorted(d for d in subdirectories if d != CHECKPOINTS and not d.startswith("."))
        if {PROVENANCE, CONFIG, METRICS} & set(files):
            found.append(Path(directory))
    return found


def read_run(folder: Path, root: Path) -> tuple[list[str], dict[str, str]]:
    """One run's cells under ``HEADER`` (``-`` for what it did not write) and its config, flattened."""
    starts, config, metrics = read_starts(folder), _flatten(_read_config(folder)), _read_metrics(folder / METRICS)
    monitor = config.get("checkpoint.monitor")
    values = _column(metrics, monitor) if monitor else []
    best = (max if config.get("checkpoint.mode", "min") == "max" else min)(values, default=0.0)
    ended = [s for s in starts if isinstance(s.get("steps"), int)]
    if ended:
        # What the trainer counted when the run last stopped: epochs completed (Lightning's current_epoch) and steps.
        epochs, steps = str(ended[-1].get("epochs", "-")), str(ended[-1]["steps"])
    else:
        epochs, steps = (str(int(max(c)) + 1) if (c := _column(metrics, k)) else "-" for k in ("epoch", "step"))
    speed = _column(metrics, "throughput/samples_per_sec")
    return [
        str(folder.relative_to(root)) if folder != root else folder.name,
        _status(starts, folder),
        f"{monitor}={best:.4g}" if values else "-",
        epochs,
        steps,
        _duration(sum(_seconds(start) for start in starts)) if starts else "-",
        f"{speed[-1]:.0f}" if speed else "-",
    ], config


def _read_config(folder: Path) -> dict[str, Any]:
    # A restart with a changed config saves it beside the first: the newest is what ran last.
    for path in reversed(configs(folder)):
        with contextlib.suppress(OSError, yaml.YAMLError):
            if isinstance(loaded := yaml.safe_load(path.read_text()), dict):
                return loaded
    return {}


def _read_metrics(path: Path) -> list[dict[str, str]]:
    """The rows of a metrics.csv up to any damage (binary junk, a row cut by a crash, a header that does not parse)."""
    rows: list[dict[str, str]] = []
    with contextlib.suppress(OSError, csv.Error), path.open(newline="", errors="replace") as f:
        for row in csv.DictReader(f):
            rows.append({k: v for k, v in row.items() if isinstance(k, str) and isinstance(v, str)})
    return rows


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    values = []
    for row in rows:
        with contextlib.suppress(ValueError):  # not a number
            values.append(float(row.get(name) or "nan"))
    return [value for value in values if not math.isnan(value)]


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    # As YAML spells them: null, true, [1, 2]; strings as they are.
    return {prefix.rstrip("."): value if isinstance(value, str) else json.dumps(value)}


def _status(starts: list[dict[str, Any]], folder: Path) -> str:
    if not starts:
        return "interrupted" if (folder / CHECKPOINTS / INTERRUPTED).exists() else "-"
    last = starts[-1]
    status = str(last.get("status", "-"))
    detail = {"interrupted": "signal", "failed": "error"}.get(status)  # what stopped it
    return f"{status} ({last.get(detail, '?')})" if detail else status


def _seconds(start: dict[str, Any]) -> float:
    if isinstance(start.get("seconds"), (int, float)):
        return float(start["seconds"])
    if start.get("status") == "running":
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return max(0.0, time.time() - datetime.fromisoformat(start["start"]).timestamp())
    return 0.0


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def table(runs: Sequence[tuple[list[str], dict[str, str]]]) -> tuple[list[str], list[list[str]]]:
    """The header and the rows: ``HEADER``'s columns, then one per config key whose value is not the same in every run
    (a missing key counts as a value)."""
    keys = sorted({key for _, config in runs for key in config} - _IGNORED_KEYS) if len(runs) > 1 else []
    keys = [key for key in keys if len({config.get(key, "-") for _, config in runs}) > 1]
    return HEADER + keys, [cells + [config.get(key, "-") for key in keys] for cells, config in runs]


def format_table(header: list[str], cells: list[list[str]], max_width: int = 60) -> str:
    """Columns aligned with spaces; a cell longer than ``max_width`` is cut with an ellipsis."""
    cut = [[c if len(c) <= max_width else c[: max_width - 3] + "..." for c in row] for row in [header, *cells]]
    widths = [max(len(row[i]) for row in cut) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cut]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m template runs [ROOT] [--csv FILE]``."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {__name__.split('.')[0]} runs",
        description="List the run folders under ROOT/lightning_logs (or ROOT): status, best monitored value, epochs, "
        "steps, duration, samples/s, and the config keys that differ between them.",
    )
    parser.add_argument("root", nargs="?", default=".", help="a folder holding lightning_logs/, or run folders")
    parser.add_argument("--csv", metavar="FILE", help="also write the table to FILE as CSV")
    args = parser.parse_args(argv)
    if "://" not in args.root:
        _print(Path(args.root), args.csv)
        return
    from template.engine.runs.remote import RemoteRoot  # object storage: its runs' files read in a local copy, no torch

    remote = RemoteRoot(args.root, option="runs ROOT")
    try:
        root = remote.fetch_all(
            lambda name: name in (PROVENANCE, CONFIG, METRICS) or name.startswith("config.restart-")
        )
        _print(root, args.csv)
    finally:
        remote.close()


def _print(root: Path, csv_path: str | None) -> None:
    if not root.is_dir():
        print(f"error: '{root}' is not a folder; pass the folder that holds lightning_logs/", file=sys.stderr)
        sys.exit(2)
    base = root / LOGS if (root / LOGS).is_dir() else root
    runs = [read_run(folder, base) for folder in find_runs(base)]
    if not runs:
        print(f"No runs under '{base}' (a run folder holds config.yaml, metrics.csv or provenance.json)")
        return
    header, rows = table(runs)
    print(format_table(header, rows))
    if csv_path:
        text = io.StringIO(newline="")
        csv.writer(text).writerows([header, *rows])
        # Imported here: they import torch, which reading the runs does not need.
        from template.engine.errors import disk_errors
        from template.engine.store import atomic_write

        # Atomically: a kill or a full disk leaves the previous file (a failure of the disk is one line, exit 3).
        with disk_errors(csv_path, kept="the table is printed above", option="--csv"):
            atomic_write(csv_path, lambda f: f.write(text.getvalue().encode()))
        print(f"Wrote {csv_path}")
