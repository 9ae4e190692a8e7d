"""A user's forecaster: the next ``horizon`` readings of a sensor from the last ``lookback`` ones, with a GRU.

Written as forecasting tutorials write it: one long series (two seasons, a trend, noise), cut in time, never
shuffled across the cut: the first 70% trains, the next 15% validates, the last 15% tests, each window inside its
part; the series is scaled by the training part's mean and spread. Training windows are shuffled among themselves.
The metric is the mean absolute error of the scaled series. ``predict_step`` returns a tensor of ``horizon``
values per window. Used from YAML (``tests/user_code/timeseries.yaml``) by ``class_path``.
"""

import math

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.regression import MeanAbsoluteError


def sensor(length: int, seed: int = 0) -> Tensor:
    """Daily and weekly seasons over a slow rise, with noise."""
    t = torch.arange(length, dtype=torch.float32)
    noise = 0.1 * torch.randn(length, generator=torch.Generator().manual_seed(seed))
    return torch.sin(2 * math.pi * t / 24) + 0.5 * torch.sin(2 * math.pi * t / 168) + 0.001 * t + noise


class SensorWindows(LightningDataModule):
    """Sliding windows of the series: ``lookback`` inputs, then ``horizon`` targets."""

    def __init__(self, length: int = 1600, lookback: int = 48, horizon: int = 6, batch_size: int = 48) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        series = sensor(h.length)
        train_end, val_end = int(0.7 * h.length), int(0.85 * h.length)
        self.mean, self.std = series[:train_end].mean(), series[:train_end].std()
        scaled = (series - self.mean) / self.std
        cuts = {"train": (0, train_end), "val": (train_end, val_end), "test": (val_end, None)}
        self.parts = {name: self._windows(scaled[start:end]) for name, (start, end) in cuts.items()}

    def _windows(self, part: Tensor) -> TensorDataset:
        h = self.hparams
        windows = part.unfold(0, h.lookback + h.horizon, 1)
        return TensorDataset(windows[:, : h.lookback], windows[:, h.lookback :])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.parts["train"], batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.parts["val"], batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.parts["test"], batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.parts["test"].tensors[0]), batch_size=self.hparams.batch_size)


class GRUForecaster(nn.Module):
    def __init__(self, horizon: int, hidden: int) -> None:
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.out = nn.Linear(hidden, horizon)

    def forward(self, history: Tensor) -> Tensor:
        _, last = self.gru(history.unsqueeze(-1))
        return self.out(last[-1])


class Forecaster(LightningModule):
    """Smooth L1 on the scaled series; MAE for validation and test."""

    def __init__(self, horizon: int = 6, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GRUForecaster(horizon, hidden)
        self.val_mae = MeanAbsoluteError()
        self.test_mae = MeanAbsoluteError()

    def forward(self, history: Tensor) -> Tensor:
        return self.model(history)

    def training_step(self, batch, batch_idx):
        history, future = batch
        loss = F.smooth_l1_loss(self(history), future)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        history, future = batch
        forecast = self(history)
        self.val_mae(forecast, future)
        self.log_dict({"val_loss": F.smooth_l1_loss(forecast, future), "val_mae": self.val_mae})

    def test_step(self, batch, batch_idx):
        history, future = batch
        self.test_mae(self(history), future)
        self.log("test_mae", self.test_mae)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), "monitor": "val_loss"},
        }
