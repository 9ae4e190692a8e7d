"""What the command line adds to a Trainer: the functions below build each piece from the parsed configuration.

``engine/cli.py`` calls them from LightningCLI's hooks and nothing else adds to a run. Each piece that changes the
run carries its ``announcement`` (``engine/mechanism.py``): what it does and the option that switches it off, which
the run's first lines list.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from typing_extensions import override

from template.engine.checkpoint_io import AtomicCheckpointIO
from template.engine.ema import ema_callbacks
from template.engine.errors import ConfigError, explain_trainer_error, one_line
from template.engine.gpus import apply_matmul_precision, hide_gpus_from_cpu_run, resolve_free_devices
from template.engine.internals import skip_idle_step_hooks
from template.engine.loggers import LogsBeforeCheckpoints, default_loggers
from template.engine.mechanism import Mechanism
from template.engine.preemption import Preemption
from template.engine.provenance import Provenance
from template.engine.run import Run, periodic_checkpoint
from template.engine.strategies import FSDP2Strategy, check_dp_trainer_config  # registers "dp" and "fsdp"
from template.engine.strategies.fsdp import check_ema, check_fsdp_trainer_config
from template.engine.trackers import TrackerRuns, has_trackers, resume_trackers
from template.engine.watchdog import HangWatchdog


def loggers(
    trainer_config: dict[str, Any], run: Run, trackers: list[Any], tracker_configs: list[Any]
) -> dict[str, Any]:
    """The ``logger`` argument: CSV and TensorBoard in the run's folder, then the trackers (a restarted named run's
    continuing their tracker runs); {} keeps the config's."""
    trackers = resume_trackers(trackers, tracker_configs, run.directory)
    logger = trainer_config.get("logger")
    if logger in (None, True):
        # The CSV logger stays first: its folder is the run's (checkpoints, config.yaml), whatever trackers add.
        root = trainer_config.get("default_root_dir")
        return {"logger": [*default_loggers(root, run.name, run.resume, run.resume_step), *trackers]}
    if not trackers:
        return {}
    if logger is False:
        raise ConfigError("trackers are set but trainer.logger is false; remove `trainer.logger: false` to log to them")
    return {"logger": [*(logger if isinstance(logger, list) else [logger]), *trackers]}


def plugins(trainer_config: dict[str, Any]) -> dict[str, Any]:
    """The ``plugins`` argument: atomic checkpoint writes, unless the config lists plugins of its own."""
    return {"plugins": [AtomicCheckpointIO()]} if trainer_config.get("plugins") is None else {}


def strategy(trainer_config: dict[str, Any]) -> dict[str, Any]:
    """The ``strategy`` argument: ``fsdp`` as an instance of the project's FSDP2 strategy, since Lightning refuses
    the name "fsdp" on CPUs before it looks the name up; {} keeps the config's."""
    return {"strategy": FSDP2Strategy()} if trainer_config.get("strategy") == FSDP2Strategy.strategy_name else {}


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
    configured = trainer_config.get("callbacks") or []
    added: list[Callback] = []
    if trainer_config.get("enable_progress_bar") is not False and not any(
        isinstance(c, ProgressBar) for c in configured
    ):
        # Lightning's default bar redraws after every step, which costs more than a small model's step here.
        added.append(TimedProgressBar(refresh_rate=10))
    if subcommand == "fit":
        check_ema(getattr(ema, "decay", None), trainer_config.get("strategy"))
        monitors = _monitors(monitor, configured if isinstance(configured, list) else [configured])
        logger = trainer_config.get("logger")
        tracked = has_trackers([*(trackers or []), *(logger if isinstance(logger, list) else [logger])])
        added += [*([MonitorCheck(monitors)] if monitors else []), *([TrackerRuns()] if tracked else [])]
        added += [LogsBeforeCheckpoints()]
        added += ema_callbacks(**vars(ema)) if ema is not None else []
        # After the callbacks that change the training state at a batch's end (the average of the weights, the
        # user's): the checkpoints written there hold this batch's changes. Provenance records the signal it stopped on.
        preemption = [Preemption(run.preemption_check_interval)] if run.preemption else []
        added += [*preemption, Provenance(), *periodic_checkpoint(run)]
    if not added:
        return {}
    return {"callbacks": [*(configured if isinstance(configured, list) else [configured]), *added]}


def check_devices(trainer_config: dict[str, Any]) -> None:
    """Hide the GPUs from a CPU run, resolve ``devices: free:N``, check dp's and fsdp's settings: before Lightning's
    less helpful checks."""
    hide_gpus_from_cpu_run(trainer_config)
    resolve_free_devices(trainer_config)
    check_dp_trainer_config(trainer_config)
    check_fsdp_trainer_config(trainer_config)


def after_trainer(trainer: Trainer, matmul_precision: str | None, configured: Any = None) -> None:
    """What needs the built Trainer: matmul precision, the launcher's process count, the watchdog's timeout, and
    idle per-batch hooks skipped on every callback but the user's (``configured``, the config's callbacks)."""
    apply_matmul_precision(matmul_precision, trainer)
    users = {id(c) for c in (configured if isinstance(configured, list) else [configured] if configured else [])}
    for callback in trainer.callbacks:
        if id(callback) not in users:
            skip_idle_step_hooks(callback)
    # Lightning compares devices x num_nodes with what torchrun or SLURM started only inside fit, with a traceback
    # from every process: compare them here, where the mismatch becomes one line.
    launcher = getattr(trainer.strategy, "launcher", None)
    if getattr(launcher, "cluster_environment", None) is not None:
        launcher.cluster_environment.validate_settings(launcher.num_processes, launcher.num_nodes)
    for callback in trainer.callbacks:
        if isinstance(callback, HangWatchdog):
            callback.arm(trainer)


def trainer_errors_as_config_errors(build: Callable[[], Trainer], trainer_config: dict[str, Any]) -> Trainer:
    """``build()`` (the checks above, the Trainer, ``after_trainer``), with Lightning's complaints about the Trainer
    settings turned into one-line ConfigErrors."""
    try:
        return build()
    except (MisconfigurationException, ValueError) as err:
        raise ConfigError(explain_trainer_error(one_line(err))) from None
    except TypeError as err:
        if "devices" not in str(err):
            raise
        raise ConfigError(
            f"trainer.devices={trainer_config.get('devices')!r} is not valid on the CPU: CPU devices are a number "
            "of processes (>= 1), not indices; set e.g. --trainer.devices=2"
        ) from None


class TimedProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, redrawn every ``refresh_rate`` training steps but at most every ``min_interval`` seconds,
    and at an epoch's last step.

    A redraw (the bar and its postfix of metrics) costs ~0.5 ms here: every 10th step of a 3 ms step is ~5 % of the
    run. A clock is read only on the steps the bar would redraw.
    """

    announcement = Mechanism(
        "progress bar",
        "redrawn every 10 steps, at most 4 times a second",
        "--trainer.enable_progress_bar=false, or your own bar",
    )

    def __init__(self, refresh_rate: int = 10, min_interval: float = 0.25) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.min_interval = min_interval
        self._drawn = float("-inf")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        n = batch_idx + 1
        if n % self.refresh_rate == 0 and n != self.total_train_batches:
            now = time.monotonic()
            if now - self._drawn < self.min_interval:
                return
            self._drawn = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class MonitorCheck(Callback):
    """Stops a run whose ``checkpoint.monitor`` (or a configured callback's ``monitor``, e.g. EarlyStopping's) the
    module does not log, with one line naming the metrics it does log.

    A validation metric is checked after the sanity check, before any training step; a training one (``train*``)
    after the first validation, when training has logged. Lightning's ModelCheckpoint finds out only at the end of
    the first training epoch, and EarlyStopping after the first validation, with a traceback.
    """

    def __init__(self, monitors: dict[str, str]) -> None:
        # option (as the user sets it) -> metric name
        self.monitors = dict(monitors)
        self._checked: set[str] = set()

    @override
    def on_sanity_check_end(self, trainer: Trainer, pl_module: Any) -> None:
        self._check(trainer, training=False)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._check(trainer, training=True)

    def _check(self, trainer: Trainer, training: bool) -> None:
        logged = sorted(trainer.callback_metrics)
        for option, metric in self.monitors.items():
            if option in self._checked or (metric.startswith("train") and not training):
                continue
            self._checked.add(option)
            if metric in logged:
                continue
            example = next((m for m in logged if m.startswith("val")), logged[0] if logged else "val_loss")
            mode = "max" if any(w in example for w in ("acc", "f1", "auc", "precision", "recall")) else "min"
            fix = (
                f"--checkpoint.monitor={example} --checkpoint.mode={mode}"
                if option == "checkpoint.monitor"
                else f"monitor: {example} (mode: {mode})"
            )
            raise ConfigError(
                f"{option}={metric!r} is not logged by the module (it logs: {', '.join(logged) or 'nothing'}); "
                f"name one of those, e.g. {fix}"
            )


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
