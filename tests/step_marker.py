"""A callback for tests that stop a run from outside: it reports each finished step in a file and paces the steps."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class StepMarker(Callback):
    """Appends ``<global_step> <time>`` to ``path`` after every training step (rank 0), then sleeps ``delay`` s."""

    def __init__(self, path: str, delay: float = 0.0) -> None:
        self.path = path
        self.delay = delay

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.is_global_zero:
            with Path(self.path).open("a") as f:
                f.write(f"{trainer.global_step} {time.time()}\n")
        time.sleep(self.delay)
