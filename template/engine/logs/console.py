"""What a run shows: its first lines (each object the engine adds carries its ``announcement``), the progress bar, and
the check that the monitored metrics are logged."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from template.engine.errors import ConfigError


@dataclass(frozen=True)
class Mechanism:
    """One thing the command line adds to a run: what it changes, and the option that switches it off."""

    name: str
    does: str
    off: str


def first_lines(trainer: Any, fit: bool) -> str:
    """The mechanisms of the Trainer's objects, in the order they act, each once with how to switch it off (an object
    whose ``announcement`` is None is idle in this run)."""
    objects = [trainer.strategy, getattr(trainer.strategy, "checkpoint_io", None), *trainer.loggers, *trainer.callbacks]
    mechanisms: dict[str, Mechanism] = {}
    for obj in objects:
        if isinstance(mechanism := getattr(obj, "announcement", None), Mechanism):
            mechanisms.setdefault(mechanism.name, mechanism)
    width = max([len(name) for name in mechanisms] + [len("checkpoints")])
    lines = [f"  {m.name:<{width}}  {m.does}  [off: {m.off}]" for m in mechanisms.values()]
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    if fit and checkpoint is not None and getattr(checkpoint, "monitor", None) is None:
        lines.append(
            f"  {'checkpoints':<{width}}  no checkpoint.monitor set: only last.ckpt is kept  "
            "[best too: --checkpoint.monitor=<a logged metric> --checkpoint.mode=min|max]"
        )
    return "\n".join(["Added by the command line [and how to switch each off]:", *lines])


@dataclass
class Throttle:
    """``ready()`` is True at most once every ``seconds``, the first time included; after ``reset()`` it is True."""

    seconds: float
    last: float = float("-inf")

    def reset(self) -> None:
        self.last = float("-inf")

    def ready(self) -> bool:
        if (now := time.monotonic()) - self.last < self.seconds:
            return False
        self.last = now
        return True


class TimedProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, redrawn every ``refresh_rate`` training steps but at most every ``min_interval`` seconds
    (a redraw can cost a small model's step), and at an epoch's last step; the clock is read only to redraw."""

    announcement = Mechanism(
        "progress bar",
        "redrawn every 10 steps, at most 4 times a second",
        "--trainer.enable_progress_bar=false, or your own bar",
    )

    def __init__(self, refresh_rate: int = 10, min_interval: float = 0.25) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._redraw = Throttle(min_interval)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        n = batch_idx + 1
        if n % self.refresh_rate == 0 and n != self.total_train_batches and not self._redraw.ready():
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class MonitorCheck(Callback):
    """Stops a run whose ``checkpoint.monitor`` (or a configured callback's ``monitor``, e.g. EarlyStopping's) the
    module does not log, in one line naming the metrics it logs: a validation metric after the sanity check, a
    training one (``train*``) after the first validation, where Lightning finds out later and with a traceback."""

    def __init__(self, monitors: dict[str, str]) -> None:
        self.monitors = dict(monitors)  # option (as the user sets it) -> metric name
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
