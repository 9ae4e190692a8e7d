"""Tracker runs that continue: a named run's MLflow and W&B runs are resumed on restart, with its config logged.

Each tracker's run id is kept in the run folder (``trackers.json``); a restart builds the tracker with it (MLflow's
``run_id``, W&B's ``id``, which Lightning's WandbLogger opens with ``resume="allow"``), so that a SLURM requeue or a
torchrun restart does not split the training curve into two tracker runs.
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


def has_trackers(loggers: Sequence[Any]) -> bool:
    """Whether any of ``loggers`` is an MLflow or W&B tracker, whose run a restart continues."""
    return any(isinstance(logger, tuple(_ID_ARGUMENT)) for logger in loggers)


def _keys(trackers: Sequence[Logger]) -> list[str | None]:
    """A name per MLflow or W&B logger (its class, numbered from the second of a class on), None for others."""
    keys: list[str | None] = []
    for tracker in trackers:
        name = type(tracker).__name__ if has_trackers([tracker]) else None
        count = sum(key is not None and key.split("#")[0] == name for key in keys)
        keys.append(None if name is None else f"{name}#{count + 1}" if count else name)
    return keys


def _saved(folder: Path) -> dict[str, dict[str, Any]]:
    try:
        saved = json.loads((folder / FILENAME).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def resume_trackers(trackers: Sequence[Logger], configs: Sequence[Any], run_folder: str | os.PathLike | None) -> list:
    """``trackers`` as configured, each MLflow or W&B one rebuilt with the id recorded in ``run_folder``, if any.

    ``configs`` are the trackers' ``class_path``/``init_args`` configs, in the same order; an id they set is kept.
    """
    if run_folder is None:
        return list(trackers)
    saved, resumed = _saved(Path(run_folder)), []
    for key, tracker, config in zip(_keys(trackers), trackers, configs, strict=True):
        argument = _ID_ARGUMENT.get(type(tracker))
        run_id = saved.get(key or "", {}).get("id")
        init_args = config.get("init_args") if isinstance(config, Mapping) else config.init_args
        init_args = dict(init_args.as_dict() if hasattr(init_args, "as_dict") else init_args or {})
        if argument is None or run_id is None or init_args.get(argument) is not None:
            resumed.append(tracker)
            continue
        cls = ContinuedMLFlowLogger if isinstance(tracker, MLFlowLogger) else type(tracker)
        resumed.append(cls(**{**init_args, argument: run_id}))
        where = Path(run_folder) / FILENAME
        rank_zero_info(f"{type(tracker).__name__}: continuing tracker run {run_id} (from {where})")
    return resumed


class ContinuedMLFlowLogger(MLFlowLogger):
    """An MLFlowLogger continuing an existing run, which skips the steps the run holds already: a restart from a
    checkpoint older than the last logged step (after a SIGKILL) logs them again, with the same values."""

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

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        log_dir = trainer.log_dir  # on every rank: Lightning broadcasts it from rank 0
        keys = _keys(trainer.loggers)
        if not trainer.is_global_zero or log_dir is None or not any(keys):
            return
        folder = Path(log_dir)
        saved = _saved(folder)
        configs = [folder / "config.yaml", *sorted(folder.glob("config.restart-*.yaml"))]
        for key, tracker in zip(keys, trainer.loggers, strict=True):
            if key is None:
                continue
            entry = saved.setdefault(key, {})
            entry["id"] = tracker.version if isinstance(tracker, WandbLogger) else tracker.run_id
            logged = set(entry.get("configs", []))
            for path in (p for p in configs if p.is_file() and p.name not in logged):
                if isinstance(tracker, MLFlowLogger):
                    tracker.experiment.log_artifact(tracker.run_id, str(path))
                else:
                    config = yaml.safe_load(path.read_text()) or {}
                    tracker.experiment.config.update({"config": config}, allow_val_change=True)
                logged.add(path.name)
            entry["configs"] = sorted(logged)
        text = json.dumps(saved, indent=1)
        atomic_write(folder / FILENAME, lambda f: f.write(text.encode()))
