"""``--test_after_fit true``: ``test`` on the best checkpoint once ``fit`` ends, logged into the same run folder."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from template.engine.atomic import atomic_write

RESULTS = "test-results.json"


def evaluate_best(trainer: Trainer, model: LightningModule, datamodule: LightningDataModule | None) -> None:
    """Run ``trainer.test`` on the fit's best checkpoint (its last weights when no metric chose one).

    The same Trainer logs the test metrics into the run's own logs (``metrics.csv``, TensorBoard, trackers), and
    rank zero writes them, with the checkpoint they come from, to ``<run folder>/test-results.json``.
    """
    callback = trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", "") or None
    rank_zero_info(f"Testing {best or 'the final weights (no best checkpoint: checkpoint.monitor is unset)'}")
    results = trainer.test(model, datamodule=datamodule, ckpt_path="best" if best else None)
    log_dir = trainer.log_dir  # on every rank: Lightning broadcasts it from rank 0
    if trainer.is_global_zero and log_dir is not None:
        text = json.dumps({"checkpoint": best, "results": results}, indent=1)
        atomic_write(Path(log_dir) / RESULTS, lambda f: f.write(text.encode()))
