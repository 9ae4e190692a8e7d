"""What the command line adds to a Trainer, each piece built from the parsed configuration; ``cli.py`` calls these
from LightningCLI's hooks. A piece that changes the run carries its ``announcement`` (``logs.console.Mechanism``):
what it does and the option that switches it off, listed in the run's first lines.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint, ProgressBar
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from template.engine.errors import ConfigError
from template.engine.internals import PROCESS_GROUP_STRATEGIES, skip_idle_step_hooks
from template.engine.jobs.preemption import Preemption
from template.engine.jobs.watchdog import HangWatchdog
from template.engine.logs.console import MonitorCheck, TimedProgressBar
from template.engine.logs.loggers import LogsBeforeCheckpoints, default_loggers
from template.engine.logs.trackers import TrackerRuns, has_trackers, resume_trackers
from template.engine.resume.checkpoints import AtomicCheckpointIO
from template.engine.resume.continuation import Run, periodic_checkpoint
from template.engine.runs import LOGS
from template.engine.runs.provenance import Provenance
from template.engine.runs.remote import RemoteRoot
from template.engine.store import atomic_write
from template.engine.strategies import FSDP2Strategy, check_dp_trainer_config  # registers "dp" and "fsdp"
from template.engine.strategies.devices import apply_matmul_precision, hide_gpus_from_cpu_run, resolve_free_devices
from template.engine.strategies.ema import ema_callbacks
from template.engine.strategies.fsdp import check_ema, check_fsdp_trainer_config


def loggers(
    trainer_config: dict[str, Any],
    run: Run,
    trackers: list[Any],
    tracker_configs: list[Any],
    remote: RemoteRoot | None = None,
) -> dict[str, Any]:
    """The ``logger`` argument: CSV and TensorBoard in the run's folder, then the trackers (a restarted named run's
    continuing their tracker runs); {} keeps the config's. ``remote``: the run folder is a copy of one on object
    storage, which gets each save."""
    trackers = resume_trackers(trackers, tracker_configs, run.directory)
    logger = trainer_config.get("logger")
    if logger in (None, True):
        # The CSV logger stays first: its folder is the run's (checkpoints, config.yaml), whatever trackers add.
        root = str(remote.local) if remote is not None else trainer_config.get("default_root_dir")
        made = default_loggers(root, LOGS, run.name, run.resume, run.resume_step)
        if remote is not None and run.directory is not None:
            for logger in made:
                logger.after_save = functools.partial(remote.sync, run.directory)
        return {"logger": [*made, *trackers]}
    if not trackers:
        return {}
    if logger is False:
        raise ConfigError("trackers are set but trainer.logger is false; remove `trainer.logger: false` to log to them")
    return {"logger": [*_listed(logger), *trackers]}


def plugins(trainer_config: dict[str, Any], remote: RemoteRoot | None = None) -> dict[str, Any]:
    """The ``plugins`` argument: atomic checkpoint writes (uploaded to ``remote``, a run folder on object storage),
    unless the config lists plugins of its own."""
    return {"plugins": [AtomicCheckpointIO(remote)]} if trainer_config.get("plugins") is None else {}


def strategy(trainer_config: dict[str, Any], configured: Any, watchdog: HangWatchdog | None) -> dict[str, Any]:
    """The ``strategy`` argument, with the watchdog's timeout for its process group; {} keeps the config's.

    ``fsdp`` is built here (Lightning refuses the name on CPUs before it looks it up). A process-group strategy given
    by class_path (``configured``: the config's entry, unbuilt) whose timeout is Lightning's default, which means
    nobody chose one, is built again with the watchdog's; one with a timeout of its own keeps it.
    ``process_group_timeout`` gives the watchdog's to the strategies Lightning builds from a name.
    """
    chosen = trainer_config.get("strategy")
    timeout = {"timeout": timedelta(seconds=watchdog.timeout)} if watchdog is not None else {}
    if chosen == FSDP2Strategy.strategy_name:
        return {"strategy": FSDP2Strategy(**timeout)}
    if not (timeout and isinstance(chosen, PROCESS_GROUP_STRATEGIES) and isinstance(configured, Namespace)):
        return {}
    init_args = configured.init_args.as_dict() if configured.get("init_args") else {}
    if init_args.get("timeout") != default_pg_timeout:
        return {}
    if any(isinstance(value, dict) for value in init_args.values()):  # objects the config holds only as classes
        rank_zero_warn(
            f"trainer.strategy ({type(chosen).__name__}) is built from objects of its own: its process group keeps "
            f"Lightning's timeout ({default_pg_timeout}); set trainer.strategy.init_args.timeout to bound a hang"
        )
        return {}
    return {"strategy": type(chosen)(**{**init_args, **timeout})}


@contextlib.contextmanager
def process_group_timeout(watchdog: HangWatchdog | None) -> Iterator[None]:
    """While the Trainer is built, each process-group strategy Lightning builds from a name (the config's, or ddp,
    which "auto" picks for several devices) gets the watchdog's timeout: its StrategyRegistry entry has it among its
    init params, unless the entry sets one of its own, and is put back afterwards."""
    if watchdog is None:
        yield
        return
    timeout = timedelta(seconds=watchdog.timeout)
    entries = {
        name: entry
        for name, entry in StrategyRegistry.items()
        if issubclass(entry["strategy"], PROCESS_GROUP_STRATEGIES) and "timeout" not in entry["init_params"]
    }
    try:
        for name, entry in entries.items():
            StrategyRegistry[name] = {**entry, "init_params": {**entry["init_params"], "timeout": timeout}}
        yield
    finally:
        StrategyRegistry.update(entries)


def callbacks(
    trainer_config: dict[str, Any],
    subcommand: str,
    run: Run,
    monitor: str | None,
    ema: Any = None,
    trackers: list[Any] | None = None,
) -> dict[str, Any]:
    """The ``callbacks`` argument: the config's, a quieter progress bar; for fit, the monitor's check, preemption,
    the run's provenance, its tracker runs (with ``trackers`` or a tracker as ``trainer.logger``), the weights'
    average (``ema``) and periodic saves."""
    configured = _listed(trainer_config.get("callbacks"))
    added: list[Callback] = []
    if trainer_config.get("enable_progress_bar") is not False and not any(
        isinstance(c, ProgressBar) for c in configured
    ):
        # Lightning's default bar redraws after every step, which costs more than a small model's step here.
        added.append(TimedProgressBar(refresh_rate=10))
    if subcommand == "fit":
        check_ema(getattr(ema, "decay", None), trainer_config.get("strategy"))
        monitors = _monitors(monitor, configured)
        tracked = has_trackers([*(trackers or []), *_listed(trainer_config.get("logger"))])
        added += [*([MonitorCheck(monitors)] if monitors else []), *([TrackerRuns()] if tracked else [])]
        added += [LogsBeforeCheckpoints()]
        added += ema_callbacks(**vars(ema)) if ema is not None else []
        # After the callbacks that change the training state at a batch's end (the average of the weights, the
        # user's): the checkpoints written there hold this batch's changes. Provenance records the signal it stopped on.
        preemption = [Preemption(run.preemption_check_interval)] if run.preemption else []
        added += [*preemption, Provenance(), *periodic_checkpoint(run)]
    return {"callbacks": [*configured, *added]} if added else {}


def check_devices(trainer_config: dict[str, Any]) -> None:
    """Hide the GPUs from a CPU run, resolve ``devices: free:N``, check dp's and fsdp's settings: before Lightning's
    less helpful checks."""
    hide_gpus_from_cpu_run(trainer_config)
    resolve_free_devices(trainer_config)
    check_dp_trainer_config(trainer_config)
    check_fsdp_trainer_config(trainer_config)


def after_trainer(trainer: Trainer, matmul_precision: str | None, configured: Any = None) -> None:
    """What needs the built Trainer: matmul precision, the launcher's process count, and idle per-batch hooks
    skipped on every callback but the user's (``configured``, the config's callbacks)."""
    apply_matmul_precision(matmul_precision, trainer)
    users = {id(c) for c in _listed(configured)}
    for callback in trainer.callbacks:
        if id(callback) not in users:
            skip_idle_step_hooks(callback)
    # Lightning compares devices x num_nodes with what torchrun or SLURM started only inside fit, with a traceback
    # from every process: compare them here, where the mismatch becomes one line.
    launcher = getattr(trainer.strategy, "launcher", None)
    if getattr(launcher, "cluster_environment", None) is not None:
        launcher.cluster_environment.validate_settings(launcher.num_processes, launcher.num_nodes)


def _listed(value: Any) -> list[Any]:
    """A config's callbacks or loggers as a list: it may give one, a list, or none."""
    return value if isinstance(value, list) else [] if value is None else [value]


def _monitors(checkpoint_monitor: str | None, configured: list[Any]) -> dict[str, str]:
    """The metrics the run's callbacks monitor, by the option that set each: ``checkpoint.monitor``, and the
    ``monitor`` of each callback in ``trainer.callbacks`` that stops a run on a missing metric (EarlyStopping)."""
    monitors = {"checkpoint.monitor": checkpoint_monitor} if checkpoint_monitor else {}
    for index, callback in enumerate(configured):
        metric = getattr(callback, "monitor", None)
        if isinstance(metric, str) and getattr(callback, "strict", True):
            monitors[f"trainer.callbacks[{index}] ({type(callback).__name__}) monitor"] = metric
    return monitors


def best_checkpoint_line(checkpoint: ModelCheckpoint | None) -> str | None:
    """The line naming the best checkpoint of a finished fit, or None when there is none to name."""
    # A user's extra ModelCheckpoint without a monitor can come first: it has a path but no score.
    if checkpoint is None or not checkpoint.best_model_path or checkpoint.best_model_score is None:
        return None
    score = float(checkpoint.best_model_score)
    return f"Best checkpoint: {checkpoint.best_model_path} ({checkpoint.monitor}={score:.4f})"


RESULTS = "test-results.json"


def evaluate_best(trainer: Trainer, model: LightningModule, datamodule: LightningDataModule | None) -> None:
    """``trainer.test`` on the fit's best checkpoint (its last weights when no metric chose one), logged into the
    run's own logs; rank zero writes the metrics and their checkpoint to ``<run folder>/test-results.json``."""
    callback = trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", "") or None
    rank_zero_info(f"Testing {best or 'the final weights (no best checkpoint: checkpoint.monitor is unset)'}")
    results = trainer.test(model, datamodule=datamodule, ckpt_path="best" if best else None)
    log_dir = trainer.log_dir  # on every rank: Lightning broadcasts it from rank 0
    if trainer.is_global_zero and log_dir is not None:
        text = json.dumps({"checkpoint": best, "results": results}, indent=1)
        atomic_write(Path(log_dir) / RESULTS, lambda f: f.write(text.encode()))


class PredictionWriter(BasePredictionWriter):
    """Saves ``<log_dir>/predictions.csv`` (one per rank under DDP) with each sample's dataset index."""

    def __init__(self, filename: str = "predictions.csv") -> None:
        super().__init__(write_interval="epoch")
        self.filename = filename

    def path(self, trainer: Trainer) -> Path:
        name = self.filename if trainer.world_size == 1 else f"{Path(self.filename).stem}-rank{trainer.global_rank}.csv"
        return Path(trainer.log_dir or trainer.default_root_dir) / name

    def write_on_epoch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        # Lightning nests both per dataloader, except predictions when there is a single dataloader.
        if predictions and not isinstance(predictions[0], torch.Tensor):
            predictions = [batch for per_loader in predictions for batch in per_loader]
        if batch_indices and batch_indices[0] and not isinstance(batch_indices[0][0], int):
            batch_indices = [indices for per_loader in batch_indices for indices in per_loader]
        path = self.path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", "prediction"])
            for batch, indices in zip(predictions, batch_indices, strict=True):
                writer.writerows(zip(indices, batch.tolist(), strict=True))
