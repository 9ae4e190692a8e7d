"""A user's own networks, LightningModule and DataModules, outside the package: used from YAML by class_path only."""

import os
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanSquaredError


class TinyNet(nn.Module):
    """A user's plain PyTorch net with its own argument names, plus the two the project links."""

    def __init__(self, input_shape: list[int], num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(input_shape[0], width), nn.Tanh(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.body(x)


class Blobs(LightningDataModule):
    """Three Gaussian blobs in 5 dimensions: a different shape and class count than the example. ``predict`` reads new
    rows from a CSV file, ``predict_path`` (5 features a line, no label), as docs/your-code.md shows."""

    num_classes = 3
    input_shape = (5,)

    def __init__(
        self, data_dir: str = "blobs", batch_size: int = 16, samples: int = 600, predict_path: str | None = None
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.samples = samples
        self.predict_path = predict_path

    def prepare_data(self) -> None:
        # Append-only log of which process ran prepare_data: the DDP test counts the lines.
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / "prepare_calls.log", "a") as f:
            f.write(f"{os.getpid()}\n")

    def setup(self, stage: str) -> None:
        if stage == "predict":
            self.new = TensorDataset(torch.from_numpy(np.loadtxt(self.predict_path, delimiter=",", ndmin=2)).float())
            return
        x, y = blobs(self.samples, seed=0)
        cut = self.samples * 4 // 5
        self.train, self.val = TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(
            self.new, batch_size=self.batch_size
        )  # in the file's order: predictions.csv's index is the row


def blobs(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` points of the three blobs and their labels: another ``seed`` draws other points around the same
    centres."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(Blobs.num_classes, *Blobs.input_shape, generator=generator) * 4
    generator = torch.Generator().manual_seed(seed) if seed else generator
    y = torch.randint(0, Blobs.num_classes, (samples,), generator=generator)
    return centres[y] + torch.randn(samples, *Blobs.input_shape, generator=generator), y


class Regressor(LightningModule):
    """A user's own LightningModule: regression, its network in `self.body`, nothing of the project's Classifier."""

    def __init__(self, body: nn.Module, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = body
        self.val_mse = MeanSquaredError()

    def forward(self, x):
        return self.body(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mse.update(self(x), y)

    def on_validation_epoch_end(self):
        self.log("val_mse", self.val_mse, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Waves(LightningDataModule):
    """y = sin(x0) + x1 / 2 with noise: a regression set with a `batch_size` the project's scaling can set."""

    def __init__(self, batch_size: int = 32, samples: int = 512) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.samples = samples

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.rand(self.samples, 2, generator=generator) * 6 - 3
        y = torch.sin(x[:, 0]) + x[:, 1] / 2 + 0.05 * torch.randn(self.samples, generator=generator)
        cut = self.samples * 3 // 4
        self.train, self.val = TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)


class BrokenStep(Regressor):
    """A user's bug in their own code: the step reads a key its batches do not have."""

    def training_step(self, batch, batch_idx):
        return {"x": batch[0]}["labels"]


class WrongShapes(Regressor):
    """A user's bug passed to a library: the batch's features are fed transposed to the network."""

    def forward(self, x):
        return self.body(x.T)
