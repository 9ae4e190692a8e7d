"""The default loggers: CSV and TensorBoard in one version folder, written to disk on a timer."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonargparse.typing import NonNegativeFloat
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers import TensorBoardLogger as _TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override

from template.engine import internals
from template.engine.errors import DiskError, disk_errors
from template.engine.logs.console import Mechanism, Throttle
from template.engine.store import atomic_write, undone_on_failure

METRICS = "metrics.csv"


class _TimedSave:
    """Writes the logger's files at most every ``save_interval`` seconds (0: at every logging step, as Lightning
    does), and always at the end of the run.

    Lightning calls ``logger.save()`` after every logging step (Lightning-AI/pytorch-lightning#4664, closed as
    won't fix), which costs more than a small model's training step. Values wait in memory until the next save or
    ``finalize``, which Lightning calls when a run ends, fails or is interrupted: a killed process loses at most the
    last ``save_interval`` seconds. A save that fails leaves the files as they were and is one line.
    """

    after_save: Callable[[], None] | None = None  # a run folder on object storage uploads the files saved

    def __init__(self, *args: Any, save_interval: NonNegativeFloat = 5.0, **kwargs: Any) -> None:
        self._saves = Throttle(save_interval)
        super().__init__(*args, **kwargs)

    def save(self) -> None:
        if self._saves.ready():
            self._write(super().save)  # type: ignore[misc]  # the Lightning logger this is mixed into

    def save_now(self) -> None:
        """Write what is buffered now, and again at the next save: a checkpoint at a batch's end comes before
        Lightning logs that step's values (and calls ``save()``)."""
        self._saves.reset()
        self.save()
        self._saves.reset()

    def finalize(self, status: str) -> None:
        self._saves.reset()
        try:
            self._write(lambda: super(_TimedSave, self).finalize(status))  # type: ignore[misc]
        except DiskError:
            if status == "success":
                raise
            # The run has failed already (often on the same disk): its own error is the one line to report.

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        # Lightning writes hparams.yaml in place when a run starts: a full disk must leave no 0-byte file.
        if rank_zero_only.rank == 0:
            self._write(lambda: super(_TimedSave, self).log_hyperparams(*args, **kwargs))  # type: ignore[misc]

    def _files(self) -> list[tuple[Path, bool]]:
        """The files a save rewrites in place, and whether each must be copied to be restored (not only cut)."""
        return [(Path(self.log_dir) / "hparams.yaml", True)]  # type: ignore[attr-defined]

    def _write(self, save: Callable[[], Any]) -> None:
        with self._disk_errors("the logs up to the last save are kept"), contextlib.ExitStack() as undo:
            for path, copy in self._files():
                undo.enter_context(undone_on_failure(path, copy=copy))
            save()
        if self.after_save is not None:
            self.after_save()

    def _disk_errors(self, kept: str) -> contextlib.AbstractContextManager[None]:
        return disk_errors(getattr(self, "log_dir", None) or "the logs", kept)


class LogsBeforeCheckpoints(Callback):
    """Writes the loggers' buffered values before each checkpoint is written.

    A run killed later resumes from its newest checkpoint: every step before it must be on disk already. Steps
    logged after it are logged again on resume, and the loggers drop the earlier copies (``resume``).
    """

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, _TimedSave):
                logger.save_now()
            else:
                logger.save()


class CSVLogger(_TimedSave, _CSVLogger):
    """Lightning's CSVLogger, writing ``metrics.csv`` at most every ``save_interval`` seconds.

    With ``resume=True`` the rows of the interrupted run are kept up to the first step the resumed run logs, and the
    rows from there on are dropped: the resumed run logs them again, so every step appears once.
    """

    announcement = Mechanism(
        "loggers",
        "CSV and TensorBoard, written every 5 s, before each checkpoint and at the end, plus trackers",
        "--trainer.logger=false, or your own logger",
    )

    def __init__(self, *args: Any, resume: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume = resume

    @property
    def experiment(self) -> Any:
        if internals.built_experiment(self) is not None or not self._resume or rank_zero_only.rank != 0:
            with self._disk_errors("nothing was written"):
                return super().experiment
        path = Path(self.log_dir) / METRICS
        rows = _kept_rows(path)  # Lightning's writer deletes an existing metrics.csv when it starts
        with self._disk_errors("nothing was written"), warnings.catch_warnings():
            # Its warning that the folder's earlier logs "will be deleted" is not true here: the rows are put back.
            warnings.filterwarnings("ignore", "Experiment logs directory .* exists and is not empty", UserWarning)
            writer = super().experiment
        if rows:
            writer.metrics = rows
            self._write(writer.save)  # back on disk at once: a run killed before its first save loses nothing
        return writer

    def _files(self) -> list[tuple[Path, bool]]:
        writer = internals.built_experiment(self)
        # Lightning appends to metrics.csv (cut back on failure), or rewrites it when new columns appear (copied).
        pending = writer is not None and writer.metrics and set().union(*writer.metrics) - set(writer.metrics_keys)
        return [*super()._files(), (Path(self.log_dir) / METRICS, bool(pending))]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._resume and step is not None and rank_zero_only.rank == 0:
            self._resume = False
            self._write(self.experiment.save)
            with self._disk_errors("the logs up to the last save are kept"):
                _drop_rows_from(Path(self.log_dir) / METRICS, step, set(metrics) - {"epoch", "step"})
        super().log_metrics(metrics, step)


class TensorBoardLogger(_TimedSave, _TensorBoardLogger):
    """Lightning's TensorBoardLogger, flushing its event file at most every ``save_interval`` seconds.

    With ``resume=True`` its first logged step tells TensorBoard to hide the interrupted run's events from the
    checkpoint's step (``resume_step``) on, as ``SummaryWriter(purge_step=...)`` would, and no second ``hp_metric``
    is logged at step 0. A run resumed after its epoch's last step logs the epoch's values one step earlier than
    the checkpoint's step, which must not hide that step's own.
    """

    announcement = CSVLogger.announcement

    def __init__(self, *args: Any, resume: bool = False, resume_step: int | None = None, **kwargs: Any) -> None:
        if resume:
            kwargs["default_hp_metric"] = False
        super().__init__(*args, **kwargs)
        self._resume, self._resume_step = resume, resume_step

    @property
    def experiment(self) -> Any:
        if internals.built_experiment(self) is not None or rank_zero_only.rank != 0:
            return super().experiment
        # SummaryWriter creates its event file when it is built: one it could not write is removed.
        folder = Path(self.log_dir)
        before = set(folder.glob("events.out.tfevents.*"))
        try:
            with self._disk_errors("nothing was written"):
                return super().experiment
        except DiskError:
            for created in set(folder.glob("events.out.tfevents.*")) - before:
                with contextlib.suppress(OSError):
                    created.unlink()
            raise

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._resume and step is not None and rank_zero_only.rank == 0:
            self._resume = False
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            purge, writer = step if self._resume_step is None else self._resume_step, self.experiment.file_writer
            writer.add_event(Event(step=purge, file_version="brain.Event:2"))
            writer.add_event(Event(step=purge, session_log=SessionLog(status=SessionLog.START)))
        super().log_metrics(metrics, step)


class DamagedMetrics(ValueError):
    """A metrics.csv that does not parse as the rows a CSVLogger writes."""


def _rows(path: Path) -> list[dict[str, str]]:
    """The rows of a metrics.csv, or DamagedMetrics: not text, no ``step`` column, a row with more or fewer cells
    than the header (cut by a crash), or a step that is not a number."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
    except (UnicodeDecodeError, csv.Error) as err:
        raise DamagedMetrics(f"not a CSV file ({err})") from None
    if rows and "step" not in (header := reader.fieldnames or []):
        raise DamagedMetrics(f"no 'step' column in its header {header[:5]}")
    for number, row in enumerate(rows, start=2):
        if None in row or None in row.values():
            raise DamagedMetrics(f"line {number} has {'more' if None in row else 'fewer'} cells than the header")
        try:
            float(row["step"])
        except ValueError:
            raise DamagedMetrics(f"line {number} has step {row['step']!r}, not a number") from None
    return rows


def _kept_rows(path: Path) -> list[dict[str, str]]:
    """The interrupted run's rows, each without its empty cells; [] when there is no metrics.csv, or a damaged one,
    which is renamed to the first free ``metrics.damaged-<n>.csv`` beside it (the run's logs start afresh)."""
    if not path.is_file():
        return []
    try:
        rows = _rows(path)
    except DamagedMetrics as err:
        n = 1
        while (aside := path.with_name(f"{path.stem}.damaged-{n}{path.suffix}")).exists():
            n += 1
        with disk_errors(path, kept="nothing was changed"):
            os.rename(path, aside)
        rank_zero_info(f"{path} is damaged ({err}): kept aside as {aside.name}; this run's logs start afresh")
        return []
    return [{k: v for k, v in row.items() if v not in ("", None)} for row in rows]


def _drop_rows_from(path: Path, step: int, keys: set[str]) -> None:
    """Rewrite ``path`` (atomically) without its rows after ``step``, nor those of ``step`` holding any of ``keys``:
    the step and the values the resumed run logs first (after its epoch's last step, the epoch's values only)."""
    try:
        rows = _rows(path) if path.is_file() else []
    except DamagedMetrics:
        return  # read when the run resumed; a file changed since is not this run's to rewrite
    kept = [r for r in rows if (s := float(r["step"])) < step or (s == step and not any(r.get(k) for k in keys))]
    if len(kept) == len(rows):
        return
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))  # every row has exactly the header's cells
    writer.writeheader()
    writer.writerows(kept)
    atomic_write(path, lambda f: f.write(text.getvalue().encode()))


def default_loggers(
    root: str | None, name: str, version: str | None = None, resume: bool = False, resume_step: int | None = None
) -> list:
    """CSV and TensorBoard logs side by side in ``<root>/<name>/<version>`` (a run's name, else the next
    ``version_N``); ``resume`` continues its logs, from the checkpoint's ``resume_step`` when known. CSV first: its
    folder is the one Lightning uses for config.yaml and checkpoints."""
    root = root or "."
    csv_logger = CSVLogger(save_dir=root, name=name, version=version, resume=resume)
    version = csv_logger.version
    tensorboard = TensorBoardLogger(save_dir=root, name=name, version=version, resume=resume, resume_step=resume_step)
    return [csv_logger, tensorboard]
