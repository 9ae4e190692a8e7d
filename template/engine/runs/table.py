"""``python -m template runs [ROOT]``: every run folder in one table, read from ``provenance.json``, ``config.yaml``
and ``metrics.csv`` alone: without torch or the user's code it answers in a moment, also where the runs' code no
longer runs. The table fits the terminal (``--wide``: all of it); ``--csv`` writes it whole, for scripts."""

from __future__ import annotations

import argparse
import contextlib
import csv
import fnmatch
import io
import itertools
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from template.engine.errors import ConfigError, disk_errors
from template.engine.logs import METRICS, read_metrics
from template.engine.runs import (
    CHECKPOINTS,
    CONFIG,
    INTERRUPTED,
    LOGS,
    PROVENANCE,
    Status,
    configs,
    is_remote,
    read_starts,
)

HEADER = ["run", "status", "best", "epochs", "steps", "duration", "samples/s"]
TESTED = "test_"  # a metric logged by test (after fit, or of a checkpoint): a column of its own


def find_runs(root: Path) -> list[Path]:
    """The run folders under ``root`` (those holding one of the files any run writes), sorted with the numbers in their
    names as numbers (version_2 before version_10); checkpoints skipped."""
    found = []
    for directory, subdirectories, files in os.walk(root):  # in order: each level's folders sorted
        subdirectories[:] = sorted((d for d in subdirectories if d != CHECKPOINTS and d[:1] != "."), key=_natural)
        if {PROVENANCE, CONFIG, METRICS} & set(files):
            found.append(Path(directory))
    return found


def read_run(folder: Path, root: Path) -> tuple[list[str], dict[str, str]]:
    """One run's cells under ``HEADER`` (``-`` for what it did not write) and its columns beyond: the last value of
    each ``test_*`` metric it logged, then its config, flattened."""
    starts, config, metrics = read_starts(folder), _flatten(_read_config(folder)), read_metrics(folder / METRICS)[0]
    monitor = config.get("checkpoint.monitor")
    values = _column(metrics, monitor) if monitor else []
    best = (max if config.get("checkpoint.mode", "min") == "max" else min)(values, default=0.0)
    # An evaluation's folder, <the run of its checkpoint>/<stage>/version_<n>, records no start: it trains nothing.
    stage = folder.parent.name if folder.parent.name in ("validate", "test", "predict") and not starts else None
    speed = _column(metrics, "throughput/samples_per_sec")
    return [
        str(folder.relative_to(root)) if folder != root else folder.name,
        stage or _status(starts, folder),
        f"{monitor}={best:.4g}" if values else "-",
        *_counted(starts, metrics, stage),
        _duration(sum(_seconds(start) for start in starts)) if starts else "-",
        f"{speed[-1]:.0f}" if speed else "-",
    ], {**_tested(metrics), **config}


def _tested(metrics: list[dict[str, str]]) -> dict[str, str]:
    """The last value of each ``test_*`` metric in ``metrics.csv``."""
    columns = {key: _column(metrics, key) for key in sorted(set().union(*metrics)) if key.startswith(TESTED)}
    return {key: f"{values[-1]:.4g}" for key, values in columns.items() if values}


def _counted(starts: list[dict[str, Any]], metrics: list[dict[str, str]], stage: str | None) -> tuple[str, str]:
    """The epochs and steps the trainer counted when the run last stopped (epochs completed: Lightning's
    ``current_epoch``), as its start recorded them, else as its ``metrics.csv`` shows them; none for an evaluation."""
    if ended := [s for s in starts if isinstance(s.get("steps"), int)]:
        return str(ended[-1].get("epochs", "-")), str(ended[-1]["steps"])
    epochs, steps = ([] if stage else _column(metrics, key) for key in ("epoch", "step"))
    return tuple(str(int(max(c)) + 1) if c else "-" for c in (epochs, steps))


def _read_config(folder: Path) -> dict[str, Any]:
    # A restart with a changed config saves it beside the first: the newest is what ran last.
    for path in reversed(configs(folder)):
        with contextlib.suppress(OSError, yaml.YAMLError):
            if isinstance(loaded := yaml.safe_load(path.read_text()), dict):
                return loaded
    return {}


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


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _status(starts: list[dict[str, Any]], folder: Path) -> str:
    if not starts:
        return Status.INTERRUPTED if (folder / CHECKPOINTS / INTERRUPTED).exists() else "-"
    last = starts[-1]
    status = str(last.get("status", "-"))
    detail = {Status.INTERRUPTED: "signal", Status.FAILED: "error"}.get(status)  # what stopped it
    return f"{status} ({last.get(detail, '?')})" if detail else status


def _seconds(start: dict[str, Any]) -> float:
    if isinstance(start.get("seconds"), (int, float)):
        return float(start["seconds"])
    if start.get("status") == Status.RUNNING:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return max(0.0, time.time() - datetime.fromisoformat(start["start"]).timestamp())
    return 0.0


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def table(
    runs: Sequence[tuple[list[str], dict[str, str]]], columns: str | None = None, where: Sequence[str] = ()
) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of the runs each ``COLUMN=PATTERN`` of ``where`` matches (shell-style): ``HEADER``'s
    columns, the ``test_*`` metrics any run logged, then one per config key whose value is not the same in every row
    (a missing key counts as a value); or the ``columns`` named, comma-separated."""
    rows = [{**dict(zip(HEADER, cells, strict=True)), **more} for cells, more in runs]
    for condition in where:
        rows = _where(rows, condition)
    # ckpt_path and run.name differ between runs without saying anything about how they differ.
    keys = sorted({key for row in rows for key in row} - {*HEADER, "ckpt_path", "run.name"})
    if columns is not None:
        header = [key for name in columns.split(",") for key in _matching(name.strip(), [*HEADER, *keys], "--columns")]
    else:
        header = [*HEADER, *_beyond(rows, keys)]
    return header, [[row.get(key, "-") for key in header] for row in rows]


def _beyond(rows: list[dict[str, str]], keys: list[str]) -> list[str]:
    """The columns shown after ``HEADER``'s by default: the test metrics, then the config keys that differ."""
    tested = [key for key in keys if key.startswith(TESTED)]
    differ = [key for key in keys if key not in tested and len({row.get(key, "-") for row in rows}) > 1]
    return tested + differ * (len(rows) > 1)


def _where(rows: list[dict[str, str]], condition: str) -> list[dict[str, str]]:
    name, equals, pattern = condition.partition("=")
    if not equals:
        raise ConfigError(f"--where {condition!r}: give COLUMN=PATTERN, e.g. --where status=finished")
    keys = _matching(name, sorted({key for row in rows for key in row}), "--where")
    return [row for row in rows if any(fnmatch.fnmatchcase(row.get(key, "-"), pattern) for key in keys)]


def _matching(name: str, keys: list[str], option: str) -> list[str]:
    """The columns ``name`` stands for: the one of that name, or each config key that ends with it (``init_args``
    left out: ``lr`` stands for ``model.init_args.optimizer.init_args.lr``)."""
    found = [key for key in keys if key == name or f".{key}".replace(".init_args.", ".").endswith(f".{name}")]
    if not found:
        raise ConfigError(f"{option}: no column {name!r}; name one of {', '.join(HEADER)}, or a config key, e.g. lr")
    return found


def format_table(header: list[str], cells: list[list[str]], max_width: int = 60, width: int | None = None) -> str:
    """Columns aligned with spaces; a cell longer than ``max_width`` is cut with an ellipsis. With ``width``, the
    columns after the first that do not fit in it are left out, as a last line says."""
    cut = [[c if len(c) <= max_width else c[: max_width - 3] + "..." for c in row] for row in [header, *cells]]
    widths = [max(len(row[i]) for row in cut) for i in range(len(header))]
    fits = max(1, sum(end <= (width or end) for end in itertools.accumulate(w + 2 for w in widths)))
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths[:fits], strict=False)).rstrip() for row in cut]
    hidden = [f"({len(widths) - fits} more columns: --wide shows them, --columns chooses)"] * (fits < len(widths))
    return "\n".join([lines[0], "  ".join("-" * w for w in widths[:fits]), *lines[1:], *hidden])


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m template runs [ROOT] [--columns A,B] [--where COLUMN=PATTERN]... [--wide] [--csv FILE]``."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {__name__.split('.')[0]} runs",
        description="List the run folders under ROOT/lightning_logs (or ROOT): status, best monitored value, epochs, "
        "steps, duration, samples/s, and the config keys that differ between them, shortened to fit the terminal. "
        "An evaluation (validate, test, predict) shows its stage as its status, under the run of its checkpoint.",
    )
    parser.add_argument("root", nargs="?", default=".", help="a folder holding lightning_logs/, or run folders")
    parser.add_argument("--columns", metavar="A,B", help="the columns to show: the header's, or config keys (lr)")
    parser.add_argument("--where", metavar="COLUMN=PATTERN", action="append", default=[], help="only the runs whose "
                        "COLUMN matches the shell-style PATTERN (status=finished, run=sweep*); repeatable")  # fmt: skip
    parser.add_argument("--wide", action="store_true", help="every column, names and values whole, however wide")
    parser.add_argument("--csv", metavar="FILE", help="also write the table whole to FILE as CSV; -: to stdout alone")
    args = parser.parse_args(argv)
    if not is_remote(args.root):
        _print(Path(args.root), args)
        return
    from template.engine.runs.remote import RemoteRoot  # object storage: its runs' files read in a local copy, no torch

    with contextlib.closing(RemoteRoot(args.root, option="runs ROOT")) as remote:
        root = remote.fetch_all(lambda n: n in (PROVENANCE, CONFIG, METRICS) or n.startswith("config.restart-"))
        _print(root, args)


def _print(root: Path, args: argparse.Namespace) -> None:
    if not root.is_dir():
        raise ConfigError(f"'{root}' is not a folder; pass the folder that holds lightning_logs/")
    base = root / LOGS if (root / LOGS).is_dir() else root
    runs = [read_run(folder, base) for folder in find_runs(base)]
    if not runs:
        print(f"No runs under '{base}' (a run folder holds config.yaml, metrics.csv or provenance.json)")
        return
    header, rows = table(runs, args.columns, args.where)
    text = io.StringIO(newline="")
    csv.writer(text).writerows([header, *rows])
    if args.csv == "-":
        print(text.getvalue(), end="")
        return
    names = [key.replace("init_args.", "") for key in header]  # a config key by its last part, where that is unique
    last = [name.rsplit(".", 1)[-1] for name in names]
    short = [name if last.count(part) > 1 else part for name, part in zip(names, last, strict=True)]
    if args.wide:  # whole names and values, however wide
        print(format_table(header, rows, max_width=10**6))
    else:
        print(format_table(short, rows, width=shutil.get_terminal_size().columns if sys.stdout.isatty() else None))
    if args.csv:
        from template.engine.store import atomic_write  # imports torch, which reading the runs does not need

        # Atomically: a kill or a full disk leaves the previous file (a failure of the disk is one line, exit 3).
        with disk_errors(args.csv, kept="the table is printed above", option="--csv"):
            atomic_write(args.csv, lambda f: f.write(text.getvalue().encode()))
        print(f"Wrote {args.csv}")
