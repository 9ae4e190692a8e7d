"""The example data: handwritten digits shipped inside the package, so nothing is downloaded."""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from template.engine import ConfigError, atomic_torch_save, disk_error, fold_indices

_ARCHIVE = "digits.csv.gz"
_CACHE = "digits.pt"


def _read_archive() -> dict[str, Tensor]:
    """Parse the packaged CSV: 64 pixel values (0..16) then the label, one image per row."""
    text = gzip.decompress(resources.files("template").joinpath("assets", _ARCHIVE).read_bytes()).decode()
    rows = torch.tensor([[int(v) for v in line.split(",")] for line in text.splitlines() if line])
    return {"images": rows[:, :-1].to(torch.uint8).reshape(-1, 1, 8, 8), "labels": rows[:, -1].long()}


class BatchedTensorDataset(TensorDataset):
    """A TensorDataset the DataLoader reads a batch at a time: one indexing per tensor, no per-sample stack."""

    # The DataLoader calls __getitems__ with the sampler's indices for a whole batch (6x the samples/s of
    # per-sample reads and default_collate for 8x8 digits here). Samplers are untouched, so Lightning's
    # DistributedSampler still splits the data under DDP.
    def __getitems__(self, indices: list[int]) -> tuple[Tensor, ...]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(tensor[index] for tensor in self.tensors)


def collate_batch(batch: tuple[Tensor, ...] | list) -> tuple[Tensor, ...] | list:
    """Collate for BatchedTensorDataset: its batches are already stacked; lists of samples go to default_collate."""
    return batch if isinstance(batch, tuple) else default_collate(batch)


class DigitsDataModule(LightningDataModule):
    """8x8 handwritten digits (UCI optdigits test set, 1797 images, 10 classes), split train/val/test.

    With ``fold`` set (``python -m template cv``), the samples outside the test split are cut into ``num_folds``
    folds stratified by label: it trains on the others and validates on fold ``fold``.
    """

    num_classes = 10
    input_shape = (1, 8, 8)

    def __init__(
        self,
        data_dir: str = "data",
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = False,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        split_seed: int = 42,
        fold: int | None = None,
        num_folds: int = 5,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(
                f"data.batch_size must be a positive integer, got {batch_size}; set e.g. --data.batch_size=64"
            )
        if num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {num_workers}")
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ConfigError(
                f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction} must be fractions "
                "in (0, 1) that leave samples for training"
            )
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.fold = fold
        self.num_folds = num_folds
        self.splits: dict[str, Dataset] = {}

    @property
    def cache_path(self) -> Path:
        return Path(self.data_dir) / _CACHE

    def prepare_data(self) -> None:
        """Materialise the packaged archive into ``data_dir`` once (Lightning calls this on one process per node)."""
        try:
            if self.cache_path.is_file():
                return
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_torch_save(_read_archive(), self.cache_path)  # whole or not at all, however many processes write
        except OSError as err:
            # Read-only, full, a file in the way, a name too long: one line naming the folder's option.
            error = disk_error(err, self.cache_path, kept="nothing was written there", option="--data.data_dir")
            if error is None:
                raise
            raise error from None
        rank_zero_info(f"Prepared the digits data set in {self.cache_path}")

    def setup(self, stage: str) -> None:
        """Load the cached tensors and split them the same way on every process and every run."""
        if self.splits:
            return
        # Not prepared on this disk (prepare_data not called, as in a notebook): the packaged archive is the source.
        data = torch.load(self.cache_path, weights_only=True) if self.cache_path.is_file() else _read_archive()
        images = data["images"].float() / 16.0
        labels = data["labels"]
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = int(len(order) * self.val_fraction)
        n_test = int(len(order) * self.test_fraction)
        parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
        if self.fold is not None:
            rest = torch.cat([parts["val"], parts["train"]])
            parts["train"], parts["val"] = fold_indices(self.fold, self.num_folds, rest, labels, seed=self.split_seed)
        self.splits = {name: BatchedTensorDataset(images[idx], labels[idx]) for name, idx in parts.items()}

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        return DataLoader(
            self.splits[split],
            batch_size=self.batch_size,
            shuffle=shuffle,
            collate_fn=collate_batch,
            num_workers=self.num_workers,
            pin_memory=self._pin_memory(),
            persistent_workers=self.persistent_workers,
        )

    def _pin_memory(self) -> bool:
        # None = auto: page-locked batches copy to a GPU asynchronously; on the CPU pinning only costs time.
        if self.pin_memory is not None:
            return self.pin_memory
        trainer = self.trainer
        return trainer is not None and isinstance(trainer.accelerator, CUDAAccelerator)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")
