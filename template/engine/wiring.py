"""What the command line adds to a Trainer, in the order it acts, each with the option that switches it off.

``MECHANISMS`` is the list a reader (and the run's first lines) sees; the functions below it build each piece from
the parsed configuration. ``engine/cli.py`` calls them from LightningCLI's hooks and nothing else adds to a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from typing_extensions import override

from template.engine.checkpoint_io import AtomicCheckpointIO
from template.engine.ema import ema_callbacks
from template.engine.errors import ConfigError, explain_trainer_error, one_line
from template.engine.gpus import apply_matmul_precision, resolve_free_devices
from template.engine.internals import skip_idle_step_hooks
from template.engine.loggers import LogsBeforeCheckpoints, default_loggers
from template.engine.preemption import Preemption
from template.engine.provenance import Provenance
from template.engine.run import Run, periodic_checkpoint
from template.engine.strategies import FSDP2Strategy, check_dp_trainer_config  # registers "dp" and "fsdp"
from template.engine.strategies.fsdp import check_ema, check_fsdp_trainer_config, is_fsdp
from template.engine.trackers import TrackerRuns, resume_trackers
from template.engine.watchdog import HangWatchdog


@dataclass(frozen=True)
class Mechanism:
    """One thing the command line adds to a run: what it changes, and the option that switches it off."""

    name: str
    does: str
    off: str
    # Whether it is on for this run's configuration (the subcommand's section of the parsed config).
    active: Callable[[Any, str], bool]
    # Checks that only stop a wrong run, and files every run writes, are listed here but not in the first lines.
    announced: bool = True


def _trainer(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(f"trainer.{key}")
    return default if value is None else value


def _fit(config: Any, subcommand: str) -> bool:
    return subcommand == "fit"


# In the order they act: while the Trainer is built, then during the run. The first lines list those on (`announce`).
MECHANISMS: tuple[Mechanism, ...] = (
    Mechanism(
        "devices free:N",
        "picks the GPUs with the most free memory",
        "list them: --trainer.devices=[0,1]",
        lambda c, s: str(_trainer(c, "devices", "")).startswith("free:"),
    ),
    Mechanism(
        "device checks",
        "strategy dp's settings and devices checked before Lightning's own checks",
        "none (a check only stops a wrong run)",
        lambda c, s: True,
        announced=False,
    ),
    Mechanism(
        "loggers",
        "CSV and TensorBoard, written every 5 s, before each checkpoint and at the end, plus trackers",
        "--trainer.logger=false, or your own logger",
        lambda c, s: _trainer(c, "logger", True) is True,
    ),
    Mechanism(
        "atomic checkpoints",
        "written beside the target, fsynced, renamed; loaded weights-only",
        "--trainer.plugins=[]",
        lambda c, s: c.get("trainer.plugins") is None,
    ),
    Mechanism(
        "progress bar",
        "redrawn every 10 steps, at most 4 times a second",
        "--trainer.enable_progress_bar=false, or your own bar",
        lambda c, s: _trainer(c, "enable_progress_bar", True) is not False,
    ),
    Mechanism(
        "random states",
        "saved in every checkpoint per process, for an exact resume",
        "always on (it only adds to checkpoints)",
        lambda c, s: True,
    ),
    Mechanism(
        "preemption",
        "SIGTERM/SIGUSR1/Ctrl-C save interrupted.ckpt where a resume is exact, exit 128+signal (and requeue on SLURM)",
        "--run.preemption=false",
        lambda c, s: s == "fit" and c.get("run.preemption") is not False,
    ),
    Mechanism(
        "provenance",
        "provenance.json in the run's folder: command, git state, versions, devices, times, exit status",
        "none (it only writes a file)",
        _fit,
        announced=False,
    ),
    Mechanism(
        "tracker runs",
        "a named run's MLflow/W&B runs continue on restart (ids in trackers.json); the config is logged to them",
        "remove trackers",
        lambda c, s: s == "fit" and bool(c.get("trackers")),
    ),
    Mechanism(
        "ema",
        "an exponential moving average of the weights, used by validation, checkpoints and export",
        "--ema.decay=null",
        lambda c, s: s == "fit" and c.get("ema.decay") is not None,
    ),
    Mechanism(
        "periodic checkpoint",
        "last-step.ckpt every run.save_every_n_steps steps",
        "--run.save_every_n_steps=null",
        lambda c, s: s == "fit" and c.get("run.save_every_n_steps") is not None,
    ),
    Mechanism(
        "cluster check",
        "devices x num_nodes compared with what torchrun or SLURM started",
        "none (a check only stops a wrong run)",
        lambda c, s: True,
        announced=False,
    ),
    Mechanism(
        "matmul precision",
        "float32 matmuls may use TF32 on CUDA (float32_matmul_precision: auto)",
        "--float32_matmul_precision=highest",
        lambda c, s: True,
        announced=False,
    ),
    Mechanism(
        "hang watchdog",
        "a rank waiting longer than watchdog.timeout s ends the job; each rank ends its process group at exit",
        "none; raise --watchdog.timeout (Lightning's: 1800)",
        lambda c, s: True,
    ),
    Mechanism(
        "preflight",
        "before anything is written: trainer counts checked, optimizers and schedulers built from the module's "
        "parameters, values a library refuses and missing extras reported in one line (engine/preflight.py)",
        "none (a check only stops a wrong run)",
        lambda c, s: True,
        announced=False,
    ),
    Mechanism(
        "run folder",
        "created, proven writable and locked for this process before anything is written; removed again when the "
        "command stops on a mistake or the disk before its first training step (engine/run.py claim)",
        "none",
        lambda c, s: True,
        announced=False,
    ),
    Mechanism(
        "config.yaml",
        "the full config saved in the run's folder; a restart keeps the first and saves a changed one beside it",
        "none",
        lambda c, s: True,
        announced=False,
    ),
    Mechanism(
        "compile",
        "torch.compile of your module's network, in place",
        "--compile.enabled=false",
        lambda c, s: bool(c.get("compile.enabled")),
    ),
    Mechanism(
        "dp",
        "swaps your module's network attribute for DataParallel during the run",
        "another trainer.strategy",
        lambda c, s: _trainer(c, "strategy") == "dp",
    ),
    Mechanism(
        "fsdp",
        "FSDP2: a module without its own configure_model sharding gets each child module with parameters (or "
        "strategy.shard_layers) sharded, then the whole module; checkpoints are folders of shards",
        "shard in your LightningModule.configure_model, or another trainer.strategy",
        lambda c, s: is_fsdp(_trainer(c, "strategy", "")),
    ),
    Mechanism(
        "batch scaling",
        "sets data.batch_size from the global batch; scales the learning rate",
        "--scaling.global_batch_size=null --scaling.lr_scaling=none",
        lambda c, s: c.get("scaling.global_batch_size") is not None or c.get("scaling.lr_scaling") != "none",
    ),
    Mechanism(
        "monitor check",
        "a checkpoint.monitor (or EarlyStopping's monitor) the module does not log stops fit after the sanity check",
        "--checkpoint.monitor=null",
        lambda c, s: s == "fit",
        announced=False,
    ),
    Mechanism(
        "predictions",
        "predict writes predictions.csv in the run's folder",
        "none",
        lambda c, s: s == "predict",
        announced=False,
    ),
)


def announce(config: Any, subcommand: str) -> str:
    """The run's first lines: the mechanisms that are on, each with how to switch it off."""
    active = [m for m in MECHANISMS if m.announced and m.active(config, subcommand)]
    width = max(len(m.name) for m in active)
    lines = [f"  {m.name:<{width}}  {m.does}  [off: {m.off}]" for m in active]
    if subcommand == "fit" and config.get("checkpoint.monitor") is None:
        lines.append(
            f"  {'checkpoints':<{width}}  no checkpoint.monitor set: only last.ckpt is kept  "
            "[best too: --checkpoint.monitor=<a logged metric> --checkpoint.mode=min|max]"
        )
    return "\n".join(["Added by the command line [and how to switch each off]:", *lines])


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
    trainer_config: dict[str, Any], subcommand: str, run: Run, monitor: str | None, ema: Any = None
) -> dict[str, Any]:
    """The ``callbacks`` argument: the config's, a quieter progress bar; for fit, the monitor's check, preemption,
    the run's provenance, its tracker runs, the weights' average (``ema``) and periodic saves."""
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
        added += [*([MonitorCheck(monitors)] if monitors else []), TrackerRuns(), LogsBeforeCheckpoints()]
        added += ema_callbacks(**vars(ema)) if ema is not None else []
        # After the callbacks that change the training state at a batch's end (the average of the weights, the
        # user's): the checkpoints written there hold this batch's changes. Provenance records the signal it stopped on.
        added += [*([Preemption()] if run.preemption else []), Provenance(), *periodic_checkpoint(run)]
    if not added:
        return {}
    return {"callbacks": [*(configured if isinstance(configured, list) else [configured]), *added]}


def check_devices(trainer_config: dict[str, Any]) -> None:
    """Resolve ``devices: free:N``, check dp's and fsdp's settings: before Lightning's less helpful checks."""
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
