"""A user's callback with a collective on one rank only: ``trainer.log_dir`` broadcasts from rank 0."""

from lightning.pytorch import Callback, LightningModule, Trainer


class LogDirOnRankZero(Callback):
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            print("logs in", trainer.log_dir, flush=True)
