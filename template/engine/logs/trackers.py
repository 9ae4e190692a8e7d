"""Tracker runs that continue: a named run's MLflow and W&B runs are resumed on restart, with its config logged.

The tracker's own run id is kept in the run folder (``trackers.json``); a restart of the run builds the tracker with
that id (MLflow's ``run_id``, W&B's ``id``, which Lightning's WandbLogger opens with ``resume="allow"``), so that a
SLURM requeue or a torchrun restart does not split the training curve into two tracker runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger, MLFlowLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from template.engine.logs.console import Mechanism
from template.engine.store import atomic_write

FILENAME = "trackers.json"
# The constructor argument of each tracker that names the run to continue.
_ID_ARGUMENT = {MLFlowLogger: "run_id", WandbLogger: "id"}


def _keys(trackers: Sequence[Logger]) -> list[str | None]:
    """A name per MLflow or W&B logger (its class, numbered from the second of a class on), None for others."""
    keys: list[str | None] = []
    for tracker in trackers:
        name = type(tracker).__name__ if isinstance(tracker, tuple(_ID_ARGUMENT)) else None
        count = sum(key is not None and key.split("#")[0] == name for key in keys)
        keys.append(None if name is None else f"{name}#{count + 1}" if count else name)
    return keys


def has_trackers(loggers: Sequence[Any]) -> bool:
    """Whether any of ``loggers`` is an MLflow or W&B tracker, whose run a restart continues."""
    return any(isinstance(logger, tuple(_ID_ARGUMENT)) for logger in loggers)


def _read(folder: Path) -> dict[str, dict[str, Any]]:
    try:
        saved = json.loads((folder / FILENAME).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def resume_trackers(trackers: Sequence[Logger], configs: Sequence[Any], run_folder: str | os.PathLike | None) -> list:
    """``trackers`` as configured, each MLflow or W&B one rebuilt with the id recorded in ``run_folder``, if any.

    ``configs`` are the trackers' ``class_path``/``init_args`` configs, in the same order; an id set in a config
    is kept.
    """
    if run_folder is None:
        return list(trackers)
    saved = _read(Path(run_folder))
    resumed = []
    for key, tracker, config in zip(_keys(trackers), trackers, configs, strict=True):
        argument = next((a for cls, a in _ID_ARGUMENT.items() if type(tracker) is cls), None)
        run_id = saved.get(key or "", {}).get("id")
        init_args = _as_dict(config.get("init_args") if isinstance(config, Mapping) else config.init_args)
        if argument is None or run_id is None or init_args.get(argument) is not None:
            resumed.append(tracker)
            continue
        init_args[argument] = run_id
        cls = ContinuedMLFlowLogger if isinstance(tracker, MLFlowLogger) else type(tracker)
        resumed.append(cls(**init_args))
        rank_zero_info(
            f"{type(tracker).__name__}: continuing tracker run {run_id} (from {Path(run_folder) / FILENAME})"
        )
    return resumed


def _as_dict(init_args: Any) -> dict[str, Any]:
    if init_args is None:
        return {}
    return dict(init_args.as_dict() if hasattr(init_args, "as_dict") else init_args)


class ContinuedMLFlowLogger(MLFlowLogger):
    """An MLFlowLogger continuing an existing run: steps the run already holds are not logged a second time.

    A restart from a checkpoint older than the last logged step (after a SIGKILL) logs those steps again; with an
    exact resume their values are the same, so the first ones are kept, as MLflow would otherwise show both.
    """

    _logged_through: int | None = None

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._logged_through is None:
            run = self.experiment.get_run(self.run_id)
            steps = [m.step for key in run.data.metrics for m in self.experiment.get_metric_history(self.run_id, key)]
            self._logged_through = max(steps, default=-1)
        if step is not None and step <= self._logged_through:
            return
        super().log_metrics(metrics, step)


class TrackerRuns(Callback):
    """Records each MLflow and W&B tracker's run id in the run folder, and logs the run's config to it (rank 0).

    MLflow gets ``config.yaml`` (and each ``config.restart-<n>.yaml``) as artifacts; W&B gets the flattened config
    in its run config. Other loggers are left as they are.
    """

    announcement = Mechanism(
        "tracker runs",
        "a named run's MLflow/W&B runs continue on restart (ids in trackers.json); the config is logged to them",
        "remove trackers",
    )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        log_dir = trainer.log_dir  # on every rank: Lightning broadcasts it from rank 0
        if not trainer.is_global_zero or log_dir is None:
            return
        folder = Path(log_dir)
        saved = _read(folder)
        keys = _keys(trainer.loggers)
        if not any(keys):
            return
        configs = [folder / "config.yaml", *sorted(folder.glob("config.restart-*.yaml"))]
        for key, tracker in zip(keys, trainer.loggers, strict=True):
            if key is None:
                continue
            entry = saved.setdefault(key, {})
            entry["id"] = tracker.version if isinstance(tracker, WandbLogger) else tracker.run_id
            logged = set(entry.get("configs", []))
            for path in (p for p in configs if p.is_file() and p.name not in logged):
                _log_config(tracker, path)
                logged.add(path.name)
            entry["configs"] = sorted(logged)
        text = json.dumps(saved, indent=1)
        atomic_write(folder / FILENAME, lambda f: f.write(text.encode()))


def _log_config(tracker: Logger, path: Path) -> None:
    if isinstance(tracker, MLFlowLogger):
        tracker.experiment.log_artifact(tracker.run_id, str(path))
    elif isinstance(tracker, WandbLogger):
        config = yaml.safe_load(path.read_text()) or {}
        tracker.experiment.config.update({"config": config}, allow_val_change=True)
