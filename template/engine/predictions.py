"""Writes what ``predict`` computes to a CSV file, so a prediction run leaves something to read."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter


class PredictionWriter(BasePredictionWriter):
    """Saves ``<log_dir>/predictions.csv`` (one per rank under DDP) with each sample's dataset index."""

    def __init__(self, filename: str = "predictions.csv") -> None:
        super().__init__(write_interval="epoch")
        self.filename = filename

    def path(self, trainer: Trainer) -> Path:
        name = self.filename if trainer.world_size == 1 else f"{Path(self.filename).stem}-rank{trainer.global_rank}.csv"
        return Path(trainer.log_dir or trainer.default_root_dir) / name

    def write_on_epoch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        # Lightning nests both per dataloader, except predictions when there is a single dataloader.
        if predictions and not isinstance(predictions[0], torch.Tensor):
            predictions = [batch for per_loader in predictions for batch in per_loader]
        if batch_indices and batch_indices[0] and not isinstance(batch_indices[0][0], int):
            batch_indices = [indices for per_loader in batch_indices for indices in per_loader]
        path = self.path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", "prediction"])
            for batch, indices in zip(predictions, batch_indices, strict=True):
                writer.writerows(zip(indices, batch.tolist(), strict=True))
