"""The loggers: CSV and TensorBoard in one version folder, written to disk on a timer and continued on resume; MLflow
and W&B tracker runs that a restart continues."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse.typing import NonNegativeFloat
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override

from template.engine import internals
from template.engine.errors import DiskError, disk_errors
from template.engine.logs import METRICS, read_metrics
from template.engine.logs.console import Mechanism, Throttle
from template.engine.store import atomic_write, undone_on_failure

TRACKERS = "trackers.json"
_ID_ARGUMENT = {MLFlowLogger: "run_id", WandbLogger: "id"}  # the constructor argument naming the run to continue
KEPT = "the logs up to the last save are kept"


class _TimedSave:
    """Writes the logger's files at most every ``save_interval`` seconds (0: at every logging step, as Lightning does,
    which costs more than a small model's step: Lightning-AI/pytorch-lightning#4664) and when the run ends, fails or is
    interrupted (``finalize``). A failed write changes no file."""

    after_save: Callable[[], None] | None = None  # a run folder on object storage uploads the files saved

    def __init__(self, *args: Any, save_interval: NonNegativeFloat = 5.0, **kwargs: Any) -> None:
        self._saves = Throttle(save_interval)
        super().__init__(*args, **kwargs)

    @property
    def experiment(self) -> Any:
        if internals.built_experiment(self) is not None or rank_zero_only.rank != 0:
            return super().experiment  # type: ignore[misc]  # the Lightning logger this is mixed into
        # TensorBoard's writer creates its event file when it is built: one it could not write is removed.
        folder = Path(self.log_dir)  # type: ignore[attr-defined]
        before = set(folder.glob("events.out.tfevents.*"))
        try:
            with disk_errors(folder, "nothing was written"):
                return super().experiment  # type: ignore[misc]
        except DiskError:
            for created in set(folder.glob("events.out.tfevents.*")) - before:
                with contextlib.suppress(OSError):
                    created.unlink()
            raise

    def save(self) -> None:
        if self._saves.ready():
            self._write(super().save)  # type: ignore[misc]

    def save_now(self) -> None:
        """Write what is buffered, and again at the next ``save()``: a checkpoint at a batch's end comes before
        Lightning logs that step's values."""
        self._write(super().save)  # type: ignore[misc]
        self._saves.reset()

    def finalize(self, status: str) -> None:
        self._saves.reset()
        try:
            self._write(lambda: super(_TimedSave, self).finalize(status))  # type: ignore[misc]
        except DiskError:
            if status == "success":
                raise  # else the run's own failure (often on the same disk) is the line to report

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        if rank_zero_only.rank == 0:  # Lightning writes hparams.yaml in place: a full disk must leave no 0-byte file
            self._write(lambda: super(_TimedSave, self).log_hyperparams(*args, **kwargs))  # type: ignore[misc]

    def _files(self) -> list[tuple[Path, bool]]:
        """The files a save rewrites in place, and whether each is copied to be restored (else only cut back)."""
        return [(Path(self.log_dir) / "hparams.yaml", True)]  # type: ignore[attr-defined]

    def _write(self, save: Callable[[], Any]) -> None:
        with disk_errors(self.log_dir, KEPT), contextlib.ExitStack() as undo:  # type: ignore[attr-defined]
            for path, copy in self._files():
                undo.enter_context(undone_on_failure(path, copy=copy))
            save()
        if self.after_save is not None:
            self.after_save()


class LogsBeforeCheckpoints(Callback):
    """Writes the loggers' buffered values before each checkpoint: a run killed later resumes from its newest
    checkpoint, so every step before it must be on disk (the steps after it are logged again)."""

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for logger in trainer.loggers:
            (logger.save_now if isinstance(logger, _TimedSave) else logger.save)()


class ResumableCSVLogger(_TimedSave, CSVLogger):
    """Lightning's CSVLogger, writing ``metrics.csv`` at most every ``save_interval`` seconds. With ``resume=True``
    the interrupted run's rows are kept up to the first step the resumed run logs, which logs the others again."""

    announcement = Mechanism(
        "loggers",
        "CSV and TensorBoard, written every 5 s, before each checkpoint and at the end, plus trackers",
        "--trainer.logger=false, or your own logger",
    )

    def __init__(self, *args: Any, resume: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume = resume
        self._kept: list[dict[str, str]] = []  # the interrupted run's rows, put back in metrics.csv

    @property
    def experiment(self) -> Any:
        if internals.built_experiment(self) is not None or not self._resume or rank_zero_only.rank != 0:
            return super().experiment
        self._kept = _kept_rows(Path(self.log_dir) / METRICS)  # Lightning's writer deletes metrics.csv when it starts
        with warnings.catch_warnings():
            # Its warning that the folder's earlier logs "will be deleted" is not true here: the rows are put back.
            warnings.filterwarnings("ignore", "Experiment logs directory .* exists and is not empty", UserWarning)
            writer = super().experiment
        if self._kept:
            writer.metrics = list(self._kept)
            self._write(writer.save)  # at once: a run killed before its first save loses nothing
        return writer

    def _files(self) -> list[tuple[Path, bool]]:
        writer = internals.built_experiment(self)
        # Lightning appends to metrics.csv (cut back on failure), or rewrites it when new columns appear (copied).
        pending = writer is not None and writer.metrics and set().union(*writer.metrics) - set(writer.metrics_keys)
        return [*super()._files(), (Path(self.log_dir) / METRICS, bool(pending))]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._resume and step is not None and rank_zero_only.rank == 0:
            # The rows from the first step logged again on are dropped, and at that step those holding its values
            # (after an epoch's last step, the resumed run logs the epoch's values only).
            self._resume, keys = False, set(metrics) - {"epoch", "step"}
            kept = [r for r in self._kept if (s := float(r["step"])) < step or (s == step and not keys & r.keys())]
            if len(kept) < len(self._kept):
                text = io.StringIO(newline="")
                rows = csv.DictWriter(text, fieldnames=self.experiment.metrics_keys)
                rows.writeheader()
                rows.writerows(kept)
                with disk_errors(self.log_dir, KEPT):
                    atomic_write(Path(self.log_dir) / METRICS, lambda f: f.write(text.getvalue().encode()))
        super().log_metrics(metrics, step)


class ResumableTensorBoardLogger(_TimedSave, TensorBoardLogger):
    """Lightning's TensorBoardLogger, flushing its event file at most every ``save_interval`` seconds. With
    ``resume=True`` it logs no second ``hp_metric``, and its first logged step hides the interrupted run's events from
    the checkpoint's step (``resume_step``) on, as ``SummaryWriter(purge_step=...)`` would; not from that first step,
    which after an epoch's last step is one earlier (the epoch's values) and must not hide that step's own."""

    announcement = ResumableCSVLogger.announcement

    def __init__(self, *args: Any, resume: bool = False, resume_step: int | None = None, **kwargs: Any) -> None:
        if resume:
            kwargs["default_hp_metric"] = False
        super().__init__(*args, **kwargs)
        self._resume, self._resume_step = resume, resume_step

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._resume and step is not None and rank_zero_only.rank == 0:
            self._resume = False
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            purge, writer = step if self._resume_step is None else self._resume_step, self.experiment.file_writer
            writer.add_event(Event(step=purge, file_version="brain.Event:2"))
            writer.add_event(Event(step=purge, session_log=SessionLog(status=SessionLog.START)))
        super().log_metrics(metrics, step)


def _kept_rows(path: Path) -> list[dict[str, str]]:
    """The rows of an interrupted run's metrics.csv, without their empty cells; [] when there is none. One that is not
    a CSVLogger's is renamed to the first free ``metrics.damaged-<n>.csv`` beside it: the logs start afresh."""
    if not path.is_file():
        return []
    rows, damage = read_metrics(path)
    if damage is None:
        return rows
    n = 1
    while (aside := path.with_name(f"{path.stem}.damaged-{n}{path.suffix}")).exists():
        n += 1
    with disk_errors(path, kept="nothing was changed"):
        os.rename(path, aside)
    rank_zero_info(f"{path} is damaged ({damage}): kept aside as {aside.name}; this run's logs start afresh")
    return []


def run_loggers(
    root: str | None, name: str, version: str | None = None, resume: bool = False, resume_step: int | None = None
) -> list:
    """CSV and TensorBoard logs side by side in ``<root>/<name>/<version>`` (a run's name, else the next
    ``version_N``), CSV first: its folder is the run's; ``resume`` continues them, from the checkpoint's step."""
    csv_logger = ResumableCSVLogger(save_dir=root or ".", name=name, version=version, resume=resume)
    tensorboard = ResumableTensorBoardLogger(
        root or ".", name, csv_logger.version, resume=resume, resume_step=resume_step
    )
    return [csv_logger, tensorboard]


def has_trackers(loggers: Sequence[Any]) -> bool:
    """Whether any of ``loggers`` is an MLflow or W&B tracker, whose run a restart continues."""
    return any(key is not None for key in _keys(loggers))


def _keys(loggers: Sequence[Any]) -> list[str | None]:
    """A name per MLflow or W&B logger in ``trackers.json`` (its kind, numbered from the second of a kind on)."""
    keys: list[str | None] = []
    for logger in loggers:
        kind = next((cls.__name__ for cls in _ID_ARGUMENT if isinstance(logger, cls)), None)
        count = sum(key is not None and key.split("#")[0] == kind for key in keys)
        keys.append(None if kind is None else f"{kind}#{count + 1}" if count else kind)
    return keys


def _saved(folder: Path) -> dict[str, dict[str, Any]]:
    try:
        saved = json.loads((folder / TRACKERS).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def resume_trackers(trackers: Sequence[Any], configs: Sequence[Any], run_folder: str | os.PathLike | None) -> list:
    """``trackers`` as configured (``configs``: their ``class_path``/``init_args``), each MLflow or W&B one rebuilt to
    continue the tracker run whose id ``run_folder`` records, unless its config names a run itself. A requeued or
    restarted run then does not split its training curve into two tracker runs."""
    saved = _saved(Path(run_folder)) if run_folder is not None else {}
    resumed = []
    for key, tracker, config in zip(_keys(trackers), trackers, configs, strict=True):
        run_id = saved.get(key or "", {}).get("id")
        init_args = config.init_args.as_dict() if config.get("init_args") else {}
        argument = _ID_ARGUMENT.get(type(tracker))
        if argument is None or run_id is None or init_args.get(argument) is not None:
            resumed.append(tracker)
            continue
        cls = ContinuedMLFlowLogger if isinstance(tracker, MLFlowLogger) else type(tracker)
        resumed.append(cls(**{**init_args, argument: run_id}))
        rank_zero_info(f"{type(tracker).__name__}: continuing tracker run {run_id} (from {run_folder}/{TRACKERS})")
    return resumed


class ContinuedMLFlowLogger(MLFlowLogger):
    """An MLFlowLogger continuing a run, skipping the steps it holds already: a restart from a checkpoint older than
    the last logged step (after a SIGKILL) logs them again, with the same values."""

    _logged_through: int | None = None

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._logged_through is None:
            run = self.experiment.get_run(self.run_id)
            steps = [m.step for key in run.data.metrics for m in self.experiment.get_metric_history(self.run_id, key)]
            self._logged_through = max(steps, default=-1)
        if step is None or step > self._logged_through:
            super().log_metrics(metrics, step)


class TrackerRuns(Callback):
    """Records each MLflow and W&B tracker's run id in the run folder, and logs the run's config to it (rank 0):
    ``config.yaml`` (and each ``config.restart-<n>.yaml``) as MLflow artifacts, the config in W&B's run config."""

    announcement = Mechanism(
        "tracker runs",
        "a named run's MLflow/W&B runs continue on restart (ids in trackers.json); the config is logged to them",
        "remove trackers",
    )

    def __init__(self, configs: Callable[[Path], list[Path]]) -> None:
        self.configs = configs  # a run folder's configs, oldest first (``runs.configs``)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        log_dir = trainer.log_dir  # on every rank: Lightning broadcasts it from rank 0
        keys = _keys(trainer.loggers)
        if not trainer.is_global_zero or log_dir is None or not any(keys):
            return
        folder = Path(log_dir)
        saved = _saved(folder)
        for key, tracker in zip(keys, trainer.loggers, strict=True):
            if key is None:
                continue
            entry = saved.setdefault(key, {})
            entry["id"] = tracker.version if isinstance(tracker, WandbLogger) else tracker.run_id
            logged = set(entry.get("configs", []))
            for path in (p for p in self.configs(folder) if p.name not in logged):
                if isinstance(tracker, MLFlowLogger):
                    tracker.experiment.log_artifact(tracker.run_id, str(path))
                else:
                    config = yaml.safe_load(path.read_text()) or {}
                    tracker.experiment.config.update({"config": config}, allow_val_change=True)
                logged.add(path.name)
            entry["configs"] = sorted(logged)
        text = json.dumps(saved, indent=1)
        atomic_write(folder / TRACKERS, lambda f: f.write(text.encode()))
