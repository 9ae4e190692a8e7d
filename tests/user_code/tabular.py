"""A user's own tabular project, written after the example as users do: the DataModule, the LightningModule and the
network take every argument name of DigitsDataModule, Classifier and MLP, with defaults of their own (none of the
example's). Used from YAML or the command line by ``class_path`` only."""

import math
from collections.abc import Sequence

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from template.engine import fold_indices


class TabularNet(nn.Module):
    """MLP's arguments: one hidden layer, no dropout."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, hidden_sizes: Sequence[int] = (12,), dropout: float = 0.0
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = math.prod(input_shape)
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.Tanh(), nn.Dropout(dropout)]
            width = hidden
        self.layers = nn.Sequential(*layers, nn.Linear(width, num_classes))

    def forward(self, x):
        return self.layers(x)


class TabularData(LightningDataModule):
    """Two classes of rows of 6 features; DigitsDataModule's arguments, its own split and batch."""

    num_classes = 2
    input_shape = (6,)

    def __init__(
        self,
        data_dir: str = "tables",
        batch_size: int = 24,
        num_workers: int = 0,
        pin_memory: bool | None = False,
        persistent_workers: bool = True,
        val_fraction: float = 0.2,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        fold: int | None = None,
        num_folds: int = 3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(7)
        y = torch.randint(0, 2, (400,), generator=generator)
        x = torch.randn(400, 6, generator=generator) + y[:, None] * 1.5
        h = self.hparams
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(h.split_seed))
        n_val, n_test = int(len(y) * h.val_fraction), int(len(y) * h.test_fraction)
        val, test, train = order[:n_val], order[n_val : n_val + n_test], order[n_val + n_test :]
        if h.fold is not None:
            train, val = fold_indices(h.fold, h.num_folds, torch.cat([val, train]), y, seed=h.split_seed)
        self.splits = {name: TensorDataset(x[i], y[i]) for name, i in (("train", train), ("val", val), ("test", test))}

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        h = self.hparams
        workers = {"num_workers": h.num_workers, "persistent_workers": h.persistent_workers and h.num_workers > 0}
        return DataLoader(
            self.splits[split], batch_size=h.batch_size, shuffle=shuffle, pin_memory=h.pin_memory, **workers
        )

    def train_dataloader(self):
        return self._loader("train", shuffle=True)

    def val_dataloader(self):
        return self._loader("val")

    def test_dataloader(self):
        return self._loader("test")

    def predict_dataloader(self):
        return self._loader("test")


class TabularClassifier(LightningModule):
    """Classifier's arguments: plain SGD by default, logs val_loss and val_acc."""

    def __init__(
        self,
        net: nn.Module,
        num_classes: int = 2,
        optimizer: OptimizerCallable = torch.optim.SGD,
        scheduler: LRSchedulerCallable | None = torch.optim.lr_scheduler.ConstantLR,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = net
        self.optimizer = optimizer
        self.scheduler = scheduler

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters())
        if self.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler(optimizer)}
