"""The prediction writer: ``predict`` writes what the module's ``predict_step`` returns to one CSV file."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from template.engine.errors import ConfigError


class PredictionWriter(BasePredictionWriter):
    """Saves the predictions with each sample's dataset index in one CSV file, ``path`` (else ``<log_dir>/
    predictions.csv``), in the input's order: a column per dimension of a tensor (``prediction``, or ``prediction_0``
    and on), per element of a tuple (``prediction_0``...), per key of a dict (named by it). Under DDP rank 0 writes
    every process's rows. An output of another kind is refused at the first batch, before the rest is predicted."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.given = path
        self.header: list[str] | None = None
        self.rows: dict[tuple[int, int], tuple[Any, ...]] = {}  # (dataloader, dataset index) -> values

    def path(self, trainer: Trainer) -> Path:
        return Path(self.given or Path(trainer.log_dir or trainer.default_root_dir) / "predictions.csv")

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        named = columns(prediction, "prediction", len(batch_indices))
        header = [name for name, _ in named]
        if self.header not in (None, header):
            raise ConfigError(
                f"predict_step returned the columns {header} for batch {batch_idx}, {self.header} before; return the "
                "same outputs for every batch"
            )
        self.header = header
        for index, *values in zip(batch_indices, *(values for _, values in named), strict=True):
            self.rows[dataloader_idx, index] = tuple(values)

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        shares: list[Any] = [(self.header, self.rows)]
        if trainer.world_size > 1:  # each process predicted a share of the samples
            shares = [None] * trainer.world_size
            dist.all_gather_object(shares, (self.header, self.rows))
        header = next((header for header, _ in shares if header is not None), ["prediction"])
        rows = {key: values for _, share in shares for key, values in share.items()}
        path = self.path(trainer)  # on every rank: the log folder is a broadcast
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", newline="") as f:
                csv.writer(f).writerows([("index", *header), *((i, *row) for (_, i), row in sorted(rows.items()))])


def columns(output: Any, name: str, samples: int) -> list[tuple[str, list[Any]]]:
    """``output`` of a batch of ``samples`` as named columns, each a value per sample."""
    if isinstance(output, dict) and output:
        parts = [(str(key), value) for key, value in output.items()]
    elif isinstance(output, (list, tuple)) and output and all(isinstance(value, Tensor) for value in output):
        parts = [(f"{name}_{i}", value) for i, value in enumerate(output)]
    else:
        return _per_sample(output, name, samples)
    return [column for key, value in parts for column in columns(value, key, samples)]


def _per_sample(output: Any, name: str, samples: int) -> list[tuple[str, list[Any]]]:
    """The columns of a tensor with a row per sample (one per dimension after the first), or of a list or tuple of a
    number or string per sample; else a ConfigError naming what ``output`` is."""
    if isinstance(output, Tensor) and output.dim() > 0 and len(output) == samples:
        values = output.detach().reshape(samples, -1).T.tolist()
        return [(name, values[0])] if len(values) == 1 else [(f"{name}_{i}", v) for i, v in enumerate(values)]
    plain = isinstance(output, (list, tuple)) and all(isinstance(v, (int, float, str)) for v in output)
    if plain and len(output) == samples:
        return [(name, list(output))]
    what = f"a tensor of shape {tuple(output.shape)}" if isinstance(output, Tensor) else f"a {type(output).__name__}"
    what += f" of {len(output)}" if isinstance(output, (list, tuple, dict)) else ""
    returned = "predict_step returned" if name == "prediction" else f"predict_step's output {name!r} is"
    raise ConfigError(
        f"{returned} {what} for a batch of {samples} samples; the predictions file takes a tensor with a row per "
        "sample, a tuple, list or dict of them, or a list of a number or string per sample"
    )
