"""A user's own network and DataModule, outside the package: used from YAML by class_path only."""

import os
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyNet(nn.Module):
    """A user's plain PyTorch net with its own argument names, plus the two the template links."""

    def __init__(self, input_shape: list[int], num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(input_shape[0], width), nn.Tanh(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.body(x)


class Blobs(LightningDataModule):
    """Three Gaussian blobs in 5 dimensions: a different shape and class count than the example."""

    num_classes = 3
    input_shape = (5,)

    def __init__(self, data_dir: str = "blobs", batch_size: int = 16, samples: int = 600) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.samples = samples

    def prepare_data(self) -> None:
        # Append-only log of which process ran prepare_data: the DDP test counts the lines.
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / "prepare_calls.log", "a") as f:
            f.write(f"{os.getpid()}\n")

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        centres = torch.randn(self.num_classes, *self.input_shape, generator=generator) * 4
        y = torch.randint(0, self.num_classes, (self.samples,), generator=generator)
        x = centres[y] + torch.randn(self.samples, *self.input_shape, generator=generator)
        cut = self.samples * 4 // 5
        self.train, self.val = TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)
