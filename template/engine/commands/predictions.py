"""The prediction writer: ``predict`` writes what the module's ``predict_step`` returns to one CSV file."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter


class PredictionWriter(BasePredictionWriter):
    """Saves the predictions with each sample's dataset index in one CSV file, ``path`` (else ``<log_dir>/
    predictions.csv``), in the input's order: under DDP rank 0 writes every process's rows."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.given = path

    def path(self, trainer: Trainer) -> Path:
        return Path(self.given or Path(trainer.log_dir or trainer.default_root_dir) / "predictions.csv")

    def write_on_epoch_end(
        self, trainer: Trainer, pl_module: LightningModule, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        # Lightning nests both per dataloader, except predictions when there is a single dataloader.
        if len(batch_indices) == 1:
            predictions = [predictions]
        rows = {
            (loader, index): prediction
            for loader, (batches, indices) in enumerate(zip(predictions, batch_indices, strict=True))
            for batch, numbers in zip(batches, indices, strict=True)
            for index, prediction in zip(numbers, batch.tolist(), strict=True)
        }
        if trainer.world_size > 1:  # each process predicted a share of the samples
            shares: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(shares, rows)
            rows = {key: prediction for share in shares for key, prediction in share.items()}
        path = self.path(trainer)  # on every rank: the log folder is a broadcast
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", newline="") as f:
                csv.writer(f).writerows([("index", "prediction"), *((i, p) for (_, i), p in sorted(rows.items()))])
