"""The default loggers: CSV and TensorBoard in one version folder, written to disk on a timer."""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers import TensorBoardLogger as _TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from template.engine.atomic import atomic_write
from template.engine.errors import ConfigError, disk_error


class _TimedSave:
    """Writes the logger's files at most every ``save_interval`` seconds, and always at the end of the run.

    Lightning calls ``logger.save()`` after every logging step (Lightning-AI/pytorch-lightning#4664, closed as
    won't fix): a rewrite of metrics.csv's tail and a TensorBoard flush each time, which costs more than a small
    model's training step. Values are never dropped: they wait in memory until the next save or ``finalize``,
    which Lightning calls when a run ends, fails or is interrupted. A killed process loses at most the last
    ``save_interval`` seconds of values.
    """

    _last_save: float = float("-inf")

    def __init__(self, *args: Any, save_interval: float = 5.0, **kwargs: Any) -> None:
        if not save_interval >= 0:  # also refuses NaN
            raise ConfigError(
                f"trainer.logger save_interval={save_interval} is not a number of seconds >= 0; use e.g. 5 (0 "
                "writes at every logging step, as Lightning's own loggers do)"
            )
        self.save_interval = save_interval
        super().__init__(*args, **kwargs)

    def save(self) -> None:
        now = time.monotonic()
        if now - self._last_save < self.save_interval:
            return
        self._last_save = now
        self._write(super().save)  # type: ignore[misc]  # the Lightning logger this is mixed into

    def finalize(self, status: str) -> None:
        self._last_save = float("-inf")  # the end of a run always reaches the disk
        self._write(lambda: super(_TimedSave, self).finalize(status))  # type: ignore[misc]

    def _write(self, save: Any) -> None:
        try:
            save()
        except OSError as err:
            where = getattr(self, "log_dir", None) or "the logs"
            error = disk_error(err, where, kept="the logs up to the last save are kept")
            if error is None:
                raise
            raise error from None


class CSVLogger(_TimedSave, _CSVLogger):
    """Lightning's CSVLogger, writing ``metrics.csv`` at most every ``save_interval`` seconds.

    With ``resume=True`` the rows of the interrupted run are kept up to the first step the resumed run logs, and the
    rows from there on are dropped: the resumed run logs them again, so every step appears once.
    """

    def __init__(self, *args: Any, resume: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume = resume
        self._rows_kept = False

    @property
    def experiment(self) -> Any:
        if self._rows_kept or not self._resume or rank_zero_only.rank != 0:
            return super().experiment
        self._rows_kept = True  # the first call creates Lightning's writer; later calls only return it
        path = Path(self.log_dir) / "metrics.csv"
        rows = _read_rows(path)  # Lightning's writer deletes an existing metrics.csv when it starts
        writer = super().experiment
        if rows:
            writer.metrics = rows
            writer.save()  # back on disk at once: a run killed before its first save loses nothing
        return writer

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._resume and step is not None and rank_zero_only.rank == 0:
            self._resume = False
            self.experiment.save()
            _drop_rows_from(Path(self.log_dir) / "metrics.csv", step)
        super().log_metrics(metrics, step)


class TensorBoardLogger(_TimedSave, _TensorBoardLogger):
    """Lightning's TensorBoardLogger, flushing its event file at most every ``save_interval`` seconds.

    With ``resume=True`` its first logged step tells TensorBoard to hide the interrupted run's events from that step
    on (what ``SummaryWriter(purge_step=...)`` writes), and no second ``hp_metric`` is logged at step 0.
    """

    def __init__(self, *args: Any, resume: bool = False, **kwargs: Any) -> None:
        if resume:
            kwargs["default_hp_metric"] = False
        super().__init__(*args, **kwargs)
        self._resume = resume

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._resume and step is not None and rank_zero_only.rank == 0:
            self._resume = False
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            writer = self.experiment.file_writer  # SummaryWriter opens its event file when it is built
            writer.add_event(Event(step=step, file_version="brain.Event:2"))
            writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        super().log_metrics(metrics, step)


def _read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a metrics.csv, each without its empty cells; [] when there is none."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [{k: v for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def _drop_rows_from(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without its rows of ``step`` and later."""
    if not path.is_file():
        return
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames or [], list(reader)
    kept = [row for row in rows if float(row["step"]) < step]
    if len(kept) == len(rows):
        return

    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=header)
    writer.writeheader()
    writer.writerows(kept)
    atomic_write(path, lambda f: f.write(text.getvalue().encode()))


def default_loggers(root: str | None, version: str | None = None, resume: bool = False) -> list:
    """CSV and TensorBoard logs side by side in one version folder under ``root`` (``default_root_dir``).

    ``version`` names the folder (a run's name) instead of the next ``version_N``; ``resume`` continues its logs.
    """
    root = root or "."
    csv_logger = CSVLogger(save_dir=root, name="lightning_logs", version=version, resume=resume)
    # CSV first: it is the logger whose folder Lightning uses for config.yaml and checkpoints.
    tensorboard = TensorBoardLogger(save_dir=root, name="lightning_logs", version=csv_logger.version, resume=resume)
    return [csv_logger, tensorboard]
