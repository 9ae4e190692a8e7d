"""A user's own code for the benchmark's `conv` workload: a small ResNet and a DataModule of synthetic images.

Nothing here belongs to the project: the classes are named by `class_path` from the benchmark's config, as a user
names theirs (`model.net.class_path: benchmark_user.ResNet`, `data.class_path: benchmark_user.SyntheticImages`),
with this folder on PYTHONPATH. `FirstStep` is a user's callback for `--trainer.callbacks+=` (scripts/startup.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch
from lightning.pytorch import Callback, LightningDataModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 convolution where the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False),
            nn.BatchNorm2d(channels_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False),
            nn.BatchNorm2d(channels_out),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: a 3x3 stem, stages of basic blocks (each stage after the first halves the resolution),
    global average pooling and a linear classifier. `input_shape` and `num_classes` are linked from the data."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        widths: Sequence[int] = (64, 128, 256),
        blocks_per_stage: int = 1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(input_shape[0], widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        ]
        channels = widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks_per_stage):
                layers.append(BasicBlock(channels, width, stride=2 if stage > 0 and block == 0 else 1))
                channels = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class NormalizedImages(Dataset):
    """uint8 images held in memory, read a batch at a time and scaled to floats around 0 (as ToTensor + Normalize)."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.images[index].float().sub_(127.5).div_(64.0), self.labels[index]


def _batch(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return batch  # __getitems__ returns whole batches already


class SyntheticImages(LightningDataModule):
    """Random 3x32x32 uint8 images with random labels (CIFAR's shapes), made in memory: nothing to download."""

    num_classes = 10
    input_shape = (3, 32, 32)

    def __init__(
        self,
        num_samples: int = 50000,
        batch_size: int = 256,
        num_workers: int = 4,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.seed = seed
        self.train: NormalizedImages | None = None

    def setup(self, stage: str) -> None:
        if self.train is None:
            generator = torch.Generator().manual_seed(self.seed)
            shape = (self.num_samples, *self.input_shape)
            images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
            labels = torch.randint(0, self.num_classes, (self.num_samples,), generator=generator)
            self.train = NormalizedImages(images, labels)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            collate_fn=_batch,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
        )

    def val_dataloader(self) -> DataLoader:
        # The first 2,560 images again: enough for a sanity check and a short validation.
        subset = NormalizedImages(self.train.images[:2560], self.train.labels[:2560])
        return DataLoader(subset, batch_size=self.batch_size, collate_fn=_batch, num_workers=0)


class FirstStep(Callback):
    """Prints the clock time of the first training step and ends the process: start-up measured to that point."""

    def on_train_batch_start(self, *args: object) -> None:
        print(f"first step at {time.time()}", flush=True)
        sys.exit(0)
