"""A user's first prototype: two interleaved spirals of points, a small MLP, every size written in the code.

Neither class takes an argument (``__init__(self)``): the data, the network and the optimizer are fixed while the idea
is tried. No ``test_step``: nothing is tested yet. ``predict_step`` returns each point's two class probabilities.
Used from YAML (``tests/user_code/prototype.yaml``) by ``class_path``, without ``init_args``.
"""

import math

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


def spirals(points: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (points,), generator=generator)
    turn = torch.rand(points, generator=generator) * 2 * math.pi
    angle = turn + labels * math.pi
    xy = torch.stack([turn * torch.cos(angle), turn * torch.sin(angle)], 1) / math.pi
    return TensorDataset(xy + 0.05 * torch.randn(points, 2, generator=generator), labels)


class Spirals(LightningDataModule):
    def __init__(self):
        super().__init__()

    def setup(self, stage):
        self.train, self.val, self.new = spirals(1000, 0), spirals(200, 1), spirals(100, 2)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=25, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=100)

    def predict_dataloader(self):
        return DataLoader(self.new, batch_size=100)


class Prototype(LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).softmax(1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)
