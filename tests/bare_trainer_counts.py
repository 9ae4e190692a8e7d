"""A bare Lightning Trainer around the example module and data on 2 DDP CPU processes, as a script would run it, with
the collective counter. Usage: python bare_trainer_counts.py <workdir> [gpu], with the same options as
tests/logs/test_step_collectives.py gives the project; ``gpu``: one GPU instead. Lightning's launcher starts rank 1 by
running this script again."""

from __future__ import annotations

import sys

from collective_counter import CollectiveCounter
from lightning.pytorch import Trainer

from template.data import DigitsDataModule
from template.model import Classifier
from template.nets import MLP

if __name__ == "__main__":
    workdir = sys.argv[1]
    gpu = sys.argv[2:] == ["gpu"]
    devices = {"accelerator": "gpu", "devices": 1} if gpu else {"accelerator": "cpu", "strategy": "ddp", "devices": 2}
    trainer = Trainer(
        **devices, max_epochs=2, limit_train_batches=15, limit_val_batches=2,
        log_every_n_steps=5, default_root_dir=workdir, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[CollectiveCounter(f"{workdir}/counts.json")],
    )  # fmt: skip
    trainer.fit(
        Classifier(MLP((1, 8, 8), 10), num_classes=10), DigitsDataModule(data_dir=workdir, batch_size=64 if gpu else 32)
    )
