"""Test-only callback that saves the training samples each process reads in the first epoch (tests/ on PYTHONPATH)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class SampleRecorder(Callback):
    """Writes ``<dirpath>/rank<global_rank>.pt``: the images of every training batch of epoch 0, and the sampler."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.images: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 0:
            self.images.append(batch[0].detach().cpu())

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == 0:
            loader = trainer.train_dataloader
            # Lightning puts its DistributedSampler into the loader's batch sampler when it has one.
            sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
            record = {"images": torch.cat(self.images), "sampler": type(sampler).__name__}
            torch.save(record, Path(self.dirpath) / f"rank{trainer.global_rank}.pt")
