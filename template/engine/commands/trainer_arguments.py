"""What the command line adds to the Trainer it builds, each piece a Trainer argument built from the parsed config:
the loggers, the checkpoint plugin, the strategy's process-group timeout, and the callbacks a run needs."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from jsonargparse import Namespace
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DistributedSampler
from typing_extensions import override

from template.engine import internals
from template.engine.errors import ConfigError
from template.engine.jobs.preemption import Preemption, defer_signals
from template.engine.jobs.processes import RankWatchdog
from template.engine.logs import loggers as tracking
from template.engine.logs.console import MonitorCheck, TimedProgressBar
from template.engine.logs.loggers import LogsBeforeCheckpoints, run_loggers
from template.engine.resume import checkpoints
from template.engine.resume.continuation import Run, periodic_checkpoint
from template.engine.runs import LOGS, configs, evaluations
from template.engine.runs.provenance import Provenance
from template.engine.runs.remote import RemoteRoot
from template.engine.strategies import FSDP2Strategy, fsdp
from template.engine.strategies.ema import ema_callbacks


def loggers(
    trainer_config: dict[str, Any], run: Run, trackers: list[Any], config: Any, remote: RemoteRoot | None, stage: str
) -> dict[str, Any]:
    """The ``logger`` argument: CSV (first: its folder is the run's), TensorBoard, then the trackers (a restarted
    run's continuing their tracker runs); {} keeps the config's. On object storage (``remote``) each save uploads.
    validate, test and predict (``stage``) log beside the run of their checkpoint, in ``<stage>/version_<n>``."""
    trackers = tracking.resume_trackers(trackers, config.get("trackers") or [], run.directory)
    logger = trainer_config.get("logger")
    if logger in (None, True):
        root = str(remote.local) if remote is not None else trainer_config.get("default_root_dir")
        if stage != "fit":
            root = str(evaluations(root, config.get("ckpt_path")))
        made = run_loggers(root, LOGS if stage == "fit" else stage, run.name, run.resume, run.resume_step)
        for each in made if remote is not None and run.directory is not None else []:
            each.after_save = functools.partial(remote.sync, run.directory)
        return {"logger": [*made, *trackers]}
    if not trackers:
        return {}
    if logger is False:
        raise ConfigError("trackers are set but trainer.logger is false; remove `trainer.logger: false` to log to them")
    return {"logger": [*listed(logger), *trackers]}


def plugins(trainer_config: dict[str, Any], remote: RemoteRoot | None = None) -> dict[str, Any]:
    """The ``plugins`` argument: atomic checkpoint writes (uploaded on object storage), unless the config lists some."""
    return {"plugins": [checkpoints.AtomicCheckpointIO(remote)]} if trainer_config.get("plugins") is None else {}


def strategy(trainer_config: dict[str, Any], configured: Any, watchdog: RankWatchdog | None) -> dict[str, Any]:
    """The ``strategy`` argument with the watchdog's timeout for its process group; {} keeps the config's. ``fsdp`` is
    built here (Lightning refuses the name on CPUs); a process-group strategy given by class_path (``configured``)
    with Lightning's default timeout is built again with the watchdog's."""
    chosen = trainer_config.get("strategy")
    timeout = {"timeout": timedelta(seconds=watchdog.timeout)} if watchdog is not None else {}
    if chosen == FSDP2Strategy.strategy_name:
        return {"strategy": FSDP2Strategy(**timeout)}
    if not (timeout and isinstance(chosen, internals.PROCESS_GROUP_STRATEGIES) and isinstance(configured, Namespace)):
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
def process_group_timeout(watchdog: RankWatchdog | None) -> Iterator[None]:
    """While the Trainer is built, the process-group strategies Lightning builds from a name (ddp, which "auto" picks
    for several devices) get the watchdog's timeout through their StrategyRegistry entries, unless one sets its own."""
    if watchdog is None:
        yield
        return
    timeout = timedelta(seconds=watchdog.timeout)
    entries = {
        name: entry
        for name, entry in StrategyRegistry.items()
        if issubclass(entry["strategy"], internals.PROCESS_GROUP_STRATEGIES) and "timeout" not in entry["init_params"]
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
    """The ``callbacks`` argument: the config's, a quieter progress bar, and for fit what a run needs of its own."""
    configured = listed(trainer_config.get("callbacks"))
    added: list[Callback] = []
    if trainer_config.get("enable_progress_bar") is not False and not any(
        isinstance(c, ProgressBar) for c in configured
    ):
        # Lightning's default bar redraws after every step, which costs more than a small model's step.
        added.append(TimedProgressBar(refresh_rate=10))
    if subcommand == "fit":
        added += _fit_callbacks(trainer_config, configured, run, monitor, ema, trackers)
    return {"callbacks": [*configured, *added]} if added else {}


def _fit_callbacks(
    trainer_config: dict[str, Any], configured: list[Any], run: Run, monitor: str | None, ema: Any, trackers: Any
) -> list[Callback]:
    """What a fit adds: checks of the monitored metrics, tracker runs, log flushes, EMA, preemption, provenance."""
    fsdp.check_ema(getattr(ema, "decay", None), trainer_config.get("strategy"))
    monitors = {"checkpoint.monitor": monitor} if monitor else {}
    for index, callback in enumerate(configured):  # those that stop a run on a missing metric (EarlyStopping)
        if isinstance(metric := getattr(callback, "monitor", None), str) and getattr(callback, "strict", True):
            monitors[f"trainer.callbacks[{index}] ({type(callback).__name__}) monitor"] = metric
    tracked = tracking.has_trackers([*(trackers or []), *listed(trainer_config.get("logger"))])
    added: list[Callback] = [MonitorCheck(monitors)] if monitors else []
    added += [tracking.TrackerRuns(configs)] if tracked else []
    added += [LogsBeforeCheckpoints(), PaddedValidation()]
    added += ema_callbacks(**vars(ema)) if ema is not None else []
    # After the callbacks that change the state at a batch's end: the checkpoints written there hold the changes.
    preemption = [Preemption(run.preemption_check_interval)] if run.preemption else []
    if not run.preemption:
        defer_signals(False)  # the signals are Lightning's
    added += [*preemption, Provenance(), *periodic_checkpoint(run)]
    return added


def listed(value: Any) -> list[Any]:
    """A config's callbacks or loggers as a list: it may give one, a list, or none."""
    return value if isinstance(value, list) else [] if value is None else [value]


class PaddedValidation(Callback):
    """Says once when DDP's sampler repeats validation samples to give every process as many (719 -> 720): the
    metrics count those twice. Lightning says so for ``validate`` and ``test``, not inside ``fit``."""

    said = False

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for loader in [] if self.said else listed(trainer.val_dataloaders):
            sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)  # a StatefulDataLoader's too
            if isinstance(sampler, DistributedSampler) and (extra := sampler.total_size - len(sampler.dataset)) > 0:
                self.said = True
                rank_zero_info(
                    f"Validation under DDP repeats {extra} of its {len(sampler.dataset)} samples (the "
                    f"DistributedSampler gives each of the {sampler.num_replicas} processes as many): its metrics "
                    "count them twice"
                )
