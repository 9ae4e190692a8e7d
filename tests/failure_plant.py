"""Test-only callback that makes one DDP rank fail on purpose; tests name it by class_path (tests/ on PYTHONPATH)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer


class PlantedFailure(Callback):
    """Records every rank's PID, then makes rank ``rank`` raise, SIGKILL itself or hang at step ``at_step``."""

    def __init__(self, mode: str, record_dir: str, rank: int = 1, at_step: int = 2) -> None:
        if mode not in ("raise", "kill", "hang"):
            raise ValueError(f"mode must be raise, kill or hang, got {mode!r}")
        self.mode = mode
        self.record_dir = Path(record_dir)
        self.rank = rank
        self.at_step = at_step

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.record_dir.mkdir(parents=True, exist_ok=True)
        (self.record_dir / f"pid-rank{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.at_step:
            return
        (self.record_dir / "failed-at").write_text(repr(time.time()))
        if self.mode == "raise":
            raise RuntimeError(f"planted failure on rank {self.rank}")
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # hung but alive: the other ranks wait for it in the next collective
