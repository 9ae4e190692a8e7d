"""What the command line adds to a run, as the run's first lines say it: each object the engine adds (a callback,
a plugin, a logger, a strategy) carries its ``announcement``, and the lines list those of the Trainer's objects."""

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


def announcements(trainer: Any) -> list[Mechanism]:
    """The mechanisms of ``trainer``'s objects, in the order they act (strategy, checkpoint writes, loggers,
    callbacks), each once; an object whose ``announcement`` is None is idle in this run."""
    objects = [trainer.strategy, getattr(trainer.strategy, "checkpoint_io", None), *trainer.loggers, *trainer.callbacks]
    found: dict[str, Mechanism] = {}
    for obj in objects:
        mechanism = getattr(obj, "announcement", None)
        if isinstance(mechanism, Mechanism):
            found.setdefault(mechanism.name, mechanism)
    return list(found.values())


def first_lines(trainer: Any, fit: bool) -> str:
    """The run's first lines: the mechanisms that are on, each with how to switch it off."""
    mechanisms = announcements(trainer)
    width = max([len(m.name) for m in mechanisms] + [len("checkpoints")])
    lines = [f"  {m.name:<{width}}  {m.does}  [off: {m.off}]" for m in mechanisms]
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    if fit and checkpoint is not None and getattr(checkpoint, "monitor", None) is None:
        lines.append(
            f"  {'checkpoints':<{width}}  no checkpoint.monitor set: only last.ckpt is kept  "
            "[best too: --checkpoint.monitor=<a logged metric> --checkpoint.mode=min|max]"
        )
    return "\n".join(["Added by the command line [and how to switch each off]:", *lines])


class Throttle:
    """``ready()`` is True at most once every ``seconds``, the first time included; after ``reset()`` it is True."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.reset()

    def reset(self) -> None:
        self._last = float("-inf")

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True


class TimedProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, redrawn every ``refresh_rate`` training steps but at most every ``min_interval`` seconds,
    and at an epoch's last step: a redraw can cost a small model's step. The clock is read only when it would redraw.
    """

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
    module does not log, with one line naming the metrics it does log.

    A validation metric is checked after the sanity check, before any training step; a training one (``train*``)
    after the first validation, when training has logged. Lightning's ModelCheckpoint finds out only at the end of
    the first training epoch, and EarlyStopping after the first validation, with a traceback.
    """

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
