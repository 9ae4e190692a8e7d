"""A user's own DataModules as users write them: a plain ``torch.utils.data.DataLoader(..., shuffle=True)``.

Digit-shaped data (1x8x8 images, 10 classes) made from a fixed seed, so that the project's example model runs on it;
nothing is written to disk. Used from YAML or the command line by ``class_path`` only.
"""

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


def _digits(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (samples,), generator=generator)
    centres = torch.rand(10, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    x = centres[y] + 0.3 * torch.rand(samples, 1, 8, 8, generator=generator)
    return TensorDataset(x, y)


class PlainDigits(LightningDataModule):
    """The DataModule of a user who never heard of resumable loaders."""

    num_classes = 10
    input_shape = (1, 8, 8)

    def __init__(self, batch_size: int = 64, num_workers: int = 0, persistent_workers: bool = False) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.persistent_workers = persistent_workers

    def setup(self, stage: str) -> None:
        self.train, self.val = _digits(1400, 2), _digits(200, 3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
            persistent_workers=self.persistent_workers,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, num_workers=self.num_workers)


class HparamsDigits(PlainDigits):
    """Keeps its batch size in ``hparams`` only (``save_hyperparameters()``), where Lightning's batch-size finder
    also looks."""

    def __init__(self, batch_size: int = 64, num_workers: int = 0) -> None:
        LightningDataModule.__init__(self)
        self.save_hyperparameters()
        self.num_workers = num_workers
        self.persistent_workers = False

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.hparams.batch_size)


class _Stream(IterableDataset):
    """A stream with no way to save its place."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self):
        yield from self.data


class StreamDigits(PlainDigits):
    """An IterableDataset in a plain DataLoader: cannot be put back at its place in an epoch."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(self.train), batch_size=self.batch_size)


class _Endless(IterableDataset):
    """A stream without a length: its epoch ends where its data does."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        yield from self.data


class EndlessDigits(PlainDigits):
    """An IterableDataset without ``__len__`` in a plain DataLoader."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Endless(self.train), batch_size=self.batch_size)
