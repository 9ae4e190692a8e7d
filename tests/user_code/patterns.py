"""A user's own training patterns, written as Lightning's docs show them: manual optimization with two optimizers,
OneCycleLR stepped per step, ReduceLROnPlateau stepped after each validation, a WeightedRandomSampler, augmentation
drawn from the global random generators (in DataLoader workers too), two validation sets, a backbone for
``BackboneFinetuning``, state set at each epoch's start, two training loaders in a dict, a per-rank running mean. Used
from YAML or the command line by ``class_path``.
"""

import random

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset, WeightedRandomSampler
from user_code.plain_data import PlainDigits, _digits


class Net(LightningModule):
    """A small convolutional classifier with dropout, trained automatically; logs ``train_loss`` each step and as the
    epoch's mean, ``val_loss`` and ``val_acc``."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2))
        self.head = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True)  # each step's, and the epoch's mean
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class OneCycle(Net):
    """OneCycleLR over the whole run, stepped after every optimizer step."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PlateauEveryValidation(Net):
    """ReduceLROnPlateau stepped after each validation of ``val_check_interval=4``, as Lightning's docs advise."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        # threshold=10: no validation counts as an improvement, so the rate halves at each step (patience 0).
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=10)
        config = {"scheduler": scheduler, "monitor": "val_loss", "interval": "step", "frequency": 4}
        return {"optimizer": optimizer, "lr_scheduler": config}


class TwoOptimizers(Net):
    """Manual optimization: the features and the head each with an optimizer of its own, gradients clipped by hand,
    each optimizer with a scheduler the step calls."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        features, head = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        features.zero_grad()
        head.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(features, gradient_clip_val=0.5)
        features.step()
        head.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        features = torch.optim.SGD(self.features.parameters(), lr=self.hparams.lr, momentum=0.9)
        head = torch.optim.Adam(self.head.parameters(), lr=self.hparams.lr)
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.7) for o in (features, head)]
        return [features, head], schedulers


class TwoValidationSets(PlainDigits):
    """Two validation loaders: Lightning logs ``val_loss/dataloader_idx_0`` and ``val_loss/dataloader_idx_1``."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.val_b = _digits(100, 4)

    def val_dataloader(self):
        return [super().val_dataloader(), DataLoader(self.val_b, batch_size=self.batch_size)]


class Weighted(PlainDigits):
    """A WeightedRandomSampler drawing the even digits three times as often, with replacement."""

    def train_dataloader(self):
        labels = self.train.tensors[1]
        weights = torch.where(labels % 2 == 0, 3.0, 1.0)
        sampler = WeightedRandomSampler(weights, num_samples=len(labels), replacement=True)
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler)


class _Jittered(Dataset):
    """Each read flips the image at random and adds noise, drawn from the global generator ``draw`` names (torch's,
    Python's ``random``, NumPy's) or from all three."""

    def __init__(self, data: TensorDataset, draw: str) -> None:
        self.data = data
        self.draw = draw

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        x, y = self.data[index]
        if self.draw in ("python", "all"):
            x = torch.roll(x, shifts=random.randint(-1, 1), dims=-1)
        if self.draw in ("numpy", "all") and np.random.rand() < 0.5:
            x = x.flip(-1)
        if self.draw in ("torch", "all"):
            x = x + 0.05 * torch.randn_like(x)
        return x, y


class Augmented(PlainDigits):
    """Augmentation inside the Dataset's ``__getitem__``, read by a plain ``DataLoader(shuffle=True)`` in the main
    process or in ``num_workers`` workers, as most vision projects do."""

    def __init__(self, draw: str = "all", batch_size: int = 64, num_workers: int = 0, persistent: bool = False):
        super().__init__(batch_size, num_workers, persistent)
        self.draw = draw

    def train_dataloader(self):
        return DataLoader(
            _Jittered(self.train, self.draw), batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
            persistent_workers=self.persistent_workers,
        )  # fmt: skip


class Backbone(Net):
    """A ``backbone`` and a head, the optimizer over what is trainable, as ``BackboneFinetuning`` expects."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr)
        self.backbone = self.features

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr, momentum=0.9)


class EpochStart(Net):
    """State set at each epoch's start: the features frozen from epoch 1, a noise level drawn for the epoch."""

    def on_train_epoch_start(self) -> None:
        self.features.requires_grad_(self.current_epoch < 1)
        self.noise = 0.1 * torch.rand(()).item()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((x + self.noise * torch.randn_like(x), y), batch_idx)


class TwoLoaders(PlainDigits):
    """Two training loaders in a dict, the second shorter (Lightning cycles it within the epoch)."""

    def train_dataloader(self):
        short = TensorDataset(*(t[:192] for t in self.train.tensors))
        return {"a": super().train_dataloader(), "b": DataLoader(short, batch_size=self.batch_size, shuffle=True)}


class TwoLoaderNet(Net):
    """Trains on both loaders' batches of each step."""

    def training_step(self, batch, batch_idx):
        x = torch.cat([batch["a"][0], batch["b"][0]])
        y = torch.cat([batch["a"][1], batch["b"][1]])
        return super().training_step((x, y), batch_idx)


class RankMean(Net):
    """A running mean of its own rank's loss, kept across checkpoints in ``on_save_checkpoint``."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr)
        self.mean_loss = 0.0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.mean_loss = 0.9 * self.mean_loss + 0.1 * loss.item()
        return loss * (1 + 0.01 * self.mean_loss)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["mean_loss"] = self.mean_loss

    def on_load_checkpoint(self, checkpoint):
        self.mean_loss = checkpoint["mean_loss"]
