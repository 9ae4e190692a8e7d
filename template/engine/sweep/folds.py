"""K-fold splits: a DataModule that takes ``fold`` and ``num_folds`` (``PROTOCOL``) trains on the other folds and
validates on fold ``fold``, its index lists from ``fold_indices``; ``prepare`` checks one before any fold runs."""

from __future__ import annotations

import inspect
import logging
import logging.handlers
import pydoc
from typing import TYPE_CHECKING, Any

import torch
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningDataModule
from torch import Tensor

from template.engine.errors import ConfigError, config_error_in

if TYPE_CHECKING:
    from template.engine.sweep.options import Configs

PROTOCOL = "fold: int | None = None, num_folds: int = 5"
FOLD = "data.fold"
log = logging.getLogger(__name__)  # each split at debug level: what ``prepare`` reads of the user's split


def fold_indices(
    fold: int, num_folds: int, samples: Tensor | int, labels: Tensor | None = None, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """The (train, validation) indices of fold ``fold`` of ``num_folds``, both sorted, together exactly ``samples``.

    Args:
        samples: the indices to split (e.g. all but the test split), or their number ``n`` for ``0..n-1``.
        labels: each sample's class, indexed by the indices in ``samples`` (a tensor over the whole data set); given,
            each fold holds every class in the same proportion (within one sample), like scikit-learn's
            ``StratifiedKFold(shuffle=True)``; None for plain k-fold.
        seed: the same seed gives the same folds, on every process and every run.
    """
    pool = torch.arange(samples) if isinstance(samples, int) else torch.as_tensor(samples, dtype=torch.long)
    if num_folds < 2:
        raise ConfigError(f"num_folds={num_folds}: cross-validation needs at least 2 folds")
    if not 0 <= fold < num_folds:
        raise ConfigError(f"fold={fold} is not one of the {num_folds} folds 0..{num_folds - 1}")
    if num_folds > len(pool):
        raise ConfigError(f"{num_folds} folds of {len(pool)} samples: use at most {len(pool)} folds")
    order = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))]
    if labels is not None:
        classes, counts = torch.unique(labels[order], return_counts=True)
        if num_folds > int(counts.min()):
            smallest = classes[counts.argmin()].item()
            raise ConfigError(
                f"{num_folds} folds stratified by label, but class {smallest} has {int(counts.min())} samples: "
                f"use at most {int(counts.min())} folds"
            )
        # Grouped by class, each class in its shuffled order: dealing the samples out in turn gives every fold
        # each class's share within one sample, and every fold the same size within one.
        order = order[torch.sort(labels[order], stable=True).indices]
    kind = "stratified by label" if labels is not None else "plain k-fold (no labels)"
    log.debug("%d folds of %d samples, %s", num_folds, len(pool), kind, extra={"kind": kind, "samples": len(pool)})
    in_fold = torch.arange(len(order)) % num_folds == fold
    return order[~in_fold].sort().values, order[in_fold].sort().values


def prepare(configs: Configs, k: int, stratify: bool) -> tuple[str, dict[str, Any]]:
    """Refuse a DataModule that cannot be split in ``k`` folds, give every trial ``data.num_folds``; the split in
    words and the complete config. Fold 0's DataModule is set up here, so that its split's refusals come first."""
    data = configs.complete({})["data"]
    if not {"fold", "num_folds"} <= set(inspect.signature(pydoc.locate(data["class_path"])).parameters):
        raise ConfigError(
            f"{data['class_path']} cannot be cross-validated: its __init__ needs the arguments ({PROTOCOL}) and a "
            "split by template.engine.fold_indices (see docs/cv.md)"
        )
    configs.fixed["data.num_folds"] = k
    config = configs.complete({FOLD: 0})
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data")
    splits, level = logging.handlers.BufferingHandler(capacity=1000), log.level
    log.addHandler(splits)
    log.setLevel(logging.DEBUG)
    try:
        module = parser.instantiate_classes(parser.parse_object({"data": config["data"]})).data
        module.prepare_data()
        module.setup("fit")
    except Exception as err:
        if (cause := config_error_in(err)) is not None:
            raise ConfigError(f"cv.folds={k}: {cause}") from None
        raise
    finally:
        log.removeHandler(splits)
        log.setLevel(level)
    split = splits.buffer[-1] if splits.buffer else None
    if stratify and (split is None or split.kind != "stratified by label"):
        raise ConfigError(
            f"cv.stratify=true, but {data['class_path']} gives fold_indices no labels; pass labels= to it, or drop "
            "cv.stratify for plain k-fold"
        )
    said = f"{split.samples} samples, {split.kind}" if split else f"its samples, split by {data['class_path']}"
    config["data"]["init_args"]["fold"] = None
    return f"{k} folds of {said}", config
