"""A user's image project: coloured shapes on a dark background, a classifier with two heads (which shape, how much of
the image it covers), trained on a weighted sum of their losses.

Written as a vision tutorial writes it: the images are made once into ``data_dir/shapes.npz`` (``prepare_data``),
each read draws its augmentation inside the Dataset's ``__getitem__`` (a horizontal flip from torch's generator, a
vertical flip from Python's ``random``, pixel noise from NumPy's), and a plain ``DataLoader(shuffle=True,
num_workers=2)`` reads them. ``predict_step`` returns a dict of tensors, one per head. Used from YAML
(``tests/user_code/vision.yaml``) or the command line by ``class_path``.
"""

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanAbsoluteError

SHAPES = ("square", "ring", "cross")


def draw_shapes(samples: int, size: int, seed: int) -> dict[str, np.ndarray]:
    """``samples`` RGB images (uint8, channels first) of one shape each, its class and the fraction it covers."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[:size, :size]
    images = rng.integers(0, 40, (samples, 3, size, size), dtype=np.uint8)  # a dark, grainy background
    kinds = rng.integers(0, len(SHAPES), samples)
    areas = np.zeros(samples, np.float32)
    for i, kind in enumerate(kinds):
        radius = rng.uniform(3.0, size / 2.5)
        cy, cx = rng.uniform(radius, size - radius, 2)
        dy, dx = np.abs(ys - cy), np.abs(xs - cx)
        if SHAPES[kind] == "square":
            mask = (dy <= radius) & (dx <= radius)
        elif SHAPES[kind] == "ring":
            mask = (dy**2 + dx**2 <= radius**2) & (dy**2 + dx**2 >= (radius / 2) ** 2)
        else:
            mask = ((dy <= radius / 3) & (dx <= radius)) | ((dx <= radius / 3) & (dy <= radius))
        images[i][:, mask] = rng.integers(140, 256, (3, 1), dtype=np.uint8)
        areas[i] = mask.mean()
    return {"images": images, "shapes": kinds.astype(np.int64), "areas": areas}


class ShapeImages(Dataset):
    """Images with their shape and area; ``augmentations`` drawn anew at each read: ``hflip`` (torch's generator),
    ``vflip`` (Python's ``random``), ``noise`` (NumPy's). Flips keep both targets."""

    def __init__(self, images: np.ndarray, shapes: np.ndarray, areas: np.ndarray, augmentations: Sequence[str] = ()):
        self.images, self.shapes, self.areas = images, shapes, areas
        self.augmentations = set(augmentations)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        image = torch.from_numpy(self.images[index]).float() / 255
        if "hflip" in self.augmentations and torch.rand(()) < 0.5:
            image = image.flip(-1)
        if "vflip" in self.augmentations and random.random() < 0.5:
            image = image.flip(-2)
        if "noise" in self.augmentations:
            image = image + torch.from_numpy(np.random.normal(0.0, 0.05, image.shape).astype(np.float32))
        return image, torch.tensor(self.shapes[index]), torch.tensor(self.areas[index])


class ShapesData(LightningDataModule):
    """Shapes split 70/15/15 once and for all (a fixed permutation); only the training split is augmented."""

    def __init__(
        self,
        data_dir: str = "shapes",
        samples: int = 640,
        image_size: int = 16,
        batch_size: int = 32,
        num_workers: int = 2,
        augmentations: Sequence[str] = ("hflip", "vflip", "noise"),
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.samples, self.image_size = samples, image_size
        self.batch_size, self.num_workers = batch_size, num_workers
        self.augmentations = augmentations

    @property
    def file(self) -> Path:
        return self.data_dir / f"shapes-{self.samples}-{self.image_size}.npz"

    def prepare_data(self) -> None:
        if not self.file.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            np.savez(self.file, **draw_shapes(self.samples, self.image_size, seed=0))

    def setup(self, stage: str) -> None:
        with np.load(self.file) as saved:
            data = {key: saved[key] for key in saved.files}
        order = np.random.default_rng(1).permutation(self.samples)
        n_train, n_val = int(0.7 * self.samples), int(0.15 * self.samples)
        parts = {"train": order[:n_train], "val": order[n_train : n_train + n_val], "test": order[n_train + n_val :]}
        self.splits = {
            name: ShapeImages(
                data["images"][i], data["shapes"][i], data["areas"][i], self.augmentations if name == "train" else ()
            )
            for name, i in parts.items()
        }

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.batch_size, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()


class TwoHeads(LightningModule):
    """A small CNN, then a head for the shape (cross-entropy) and one for its area (MSE, weighted by
    ``area_weight``)."""

    def __init__(self, channels: int = 16, lr: float = 3e-3, area_weight: float = 4.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(4), nn.Flatten(),
        )  # fmt: skip
        self.shape_head = nn.Linear(32 * channels, len(SHAPES))
        self.area_head = nn.Linear(32 * channels, 1)
        self.val_acc = MulticlassAccuracy(len(SHAPES))
        self.val_area_mae = MeanAbsoluteError()
        self.test_acc = MulticlassAccuracy(len(SHAPES))
        self.test_area_mae = MeanAbsoluteError()

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        features = self.backbone(images)
        return self.shape_head(features), self.area_head(features).squeeze(-1)

    def _losses(self, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        images, shapes, areas = batch
        logits, area = self(images)
        shape_loss, area_loss = F.cross_entropy(logits, shapes), F.mse_loss(area, areas)
        return shape_loss + self.hparams.area_weight * area_loss, logits, area, shape_loss

    def training_step(self, batch, batch_idx):
        loss, _, _, shape_loss = self._losses(batch)
        self.log_dict({"train_loss": loss, "train_shape_loss": shape_loss})
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits, area, _ = self._losses(batch)
        self.val_acc(logits, batch[1])
        self.val_area_mae(area, batch[2])
        self.log_dict({"val_loss": loss, "val_acc": self.val_acc, "val_area_mae": self.val_area_mae})

    def test_step(self, batch, batch_idx):
        _, logits, area, _ = self._losses(batch)
        self.test_acc(logits, batch[1])
        self.test_area_mae(area, batch[2])
        self.log_dict({"test_acc": self.test_acc, "test_area_mae": self.test_area_mae})

    def predict_step(self, batch, batch_idx):
        logits, area = self(batch[0])
        return {"shape": logits.argmax(-1), "area": area}

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-4)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_epochs)
        return [optimizer], [scheduler]
