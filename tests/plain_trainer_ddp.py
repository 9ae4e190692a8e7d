"""The example DataModule under a plain Trainer with 2 DDP processes on CPU, as a notebook or script would run it.

Usage: python plain_trainer_ddp.py <workdir>. Lightning's launcher starts rank 1 by running this script again.
"""

from __future__ import annotations

import sys

from lightning.pytorch import Trainer
from sample_recorder import SampleRecorder

from template.data import DigitsDataModule
from template.model import Classifier
from template.nets import MLP

if __name__ == "__main__":
    workdir = sys.argv[1]
    trainer = Trainer(
        accelerator="cpu", strategy="ddp", devices=2, max_epochs=1, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=workdir,
        callbacks=[SampleRecorder(workdir)],
    )  # fmt: skip
    trainer.fit(Classifier(MLP((1, 8, 8), 10), num_classes=10), DigitsDataModule(data_dir=workdir, batch_size=32))
