"""A callback for tests that stop a run from outside: it reports each finished step in a file and paces the steps."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class StepMarker(Callback):
    """Appends ``<global_step> <time>`` to ``path`` after every training step (rank 0), then sleeps ``delay`` s.

    ``val_delay`` > 0 also paces validation: ``sanity <step> <time>`` or ``val <step> <time>`` after each validation
    batch, then a sleep; ``end_delay`` > 0 writes ``end <step> <time>`` in ``on_train_end`` and sleeps there.
    ``exit_delay`` > 0 makes rank 0's exit slow: a sleep when the run stops, before Lightning writes the logs.
    ``hold``: a file; while it exists, each step ends only when it is removed (a test holds the training thread).
    """

    def __init__(
        self,
        path: str,
        delay: float = 0.0,
        val_delay: float = 0.0,
        end_delay: float = 0.0,
        exit_delay: float = 0.0,
        hold: str | None = None,
    ) -> None:
        self.path = path
        self.delay = delay
        self.val_delay = val_delay
        self.end_delay = end_delay
        self.exit_delay = exit_delay
        self.hold = hold

    def _mark(self, trainer: Trainer, *prefix: str) -> None:
        if trainer.is_global_zero:
            with Path(self.path).open("a") as f:
                f.write(" ".join([*prefix, f"{trainer.global_step} {time.time()}"]) + "\n")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._mark(trainer)
        time.sleep(self.delay)
        while self.hold and Path(self.hold).exists():
            time.sleep(0.1)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.val_delay:
            self._mark(trainer, "sanity" if trainer.sanity_checking else "val")
            time.sleep(self.val_delay)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.end_delay:
            self._mark(trainer, "end")
            time.sleep(self.end_delay)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.exit_delay and trainer.is_global_zero:
            time.sleep(self.exit_delay)
