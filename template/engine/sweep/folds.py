"""K-fold splits: a DataModule that takes ``fold`` and ``num_folds`` (``PROTOCOL``) trains on the other folds and
validates on fold ``fold``, its index lists from ``fold_indices``."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from template.engine.errors import ConfigError

PROTOCOL = "fold: int | None = None, num_folds: int = 5"
FOLD = "data.fold"
log = logging.getLogger(__name__)  # each split at debug level: what the cv reads of the user's split


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
        # Grouped by class, each in its shuffled order: dealt out in turn, every fold gets each class's share and
        # the same size, within one sample.
        order = order[torch.sort(labels[order], stable=True).indices]
    kind = "stratified by label" if labels is not None else "plain k-fold (no labels)"
    log.debug("%d folds of %d samples, %s", num_folds, len(pool), kind, extra={"kind": kind, "samples": len(pool)})
    in_fold = torch.arange(len(order)) % num_folds == fold
    return order[~in_fold].sort().values, order[in_fold].sort().values
