"""A fault injector for tests: a callback that sends its own process a signal at one chosen moment of a run.

Deterministic, not timed: the moment is a hook and a position (epoch, batch, step), so a test names exactly where
a run is stopped. ``SIGKILL`` ends the process at that moment with nothing written on the way out, as the OOM killer
or a lost node would.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

# The moments a fault can be placed at, and the hook each one fires in.
MOMENTS = (
    "train_start",  # as training starts, Lightning's signal handlers installed (a resumed run has no sanity check)
    "train_batch",  # after training batch `batch` of epoch `epoch` (micro-batches count under accumulation)
    "sanity_batch",  # after the sanity check's validation batch `batch`
    "val_batch",  # after validation batch `batch` of the `nth` validation run of fit (0 = the first after training)
    "epoch_end",  # at the end of training epoch `epoch`
    "checkpoint",  # while the `nth` checkpoint of the run is being assembled (before its file is written)
    "train_end",  # after the last step
    "teardown",  # while fit tears down
    "test_after_fit",  # while the best checkpoint is tested after fit (--test_after_fit=true): the run has ended
)


class Fault(Callback):
    """Sends ``signal`` (a name: SIGTERM, SIGUSR1, SIGINT, SIGKILL) to this process at ``moment``, once.

    ``ranks``: the global ranks that signal themselves (default: rank 0 only). ``group``: the lowest of ``ranks`` sends
    the signal to its whole process group instead (every DDP rank, DataLoader worker and the launcher, as a scheduler's
    time limit or a terminal's Ctrl-C sends it). ``once_file``: a file created when the fault fires; while it exists
    the fault stays quiet, so that the same command, started again, runs through.
    """

    def __init__(
        self,
        moment: str,
        signal: str = "SIGTERM",
        epoch: int = 0,
        batch: int = 0,
        nth: int = 0,
        ranks: list[int] | None = None,
        group: bool = False,
        once_file: str = "fault.fired",
    ) -> None:
        if moment not in MOMENTS:
            raise ValueError(f"moment={moment!r}; one of {', '.join(MOMENTS)}")
        self.moment = moment
        self.signum = _signum(signal)
        self.epoch = epoch
        self.batch = batch
        self.nth = nth
        self.ranks = [0] if ranks is None else ranks
        self.group = group
        self.once_file = Path(once_file)
        self._validations = 0
        self._checkpoints = 0
        self._quiet = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Decided once per start: under DDP one rank's file must not silence the other ranks' fault.
        self._quiet = self.once_file.exists()

    def _fire(self, trainer: Trainer) -> None:
        if self._quiet or trainer.global_rank not in self.ranks:
            return
        self._quiet = True
        first = trainer.global_rank == min(self.ranks)
        if first:
            self.once_file.write_text(f"{self.moment} step {trainer.global_step}\n")
        if not self.group:
            os.kill(os.getpid(), self.signum)
        elif first:
            os.killpg(os.getpgrp(), self.signum)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.moment == "train_start":
            self._fire(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, out: Any, batch: Any, i: int) -> None:
        if self.moment == "train_batch" and (trainer.current_epoch, i) == (self.epoch, self.batch):
            self._fire(trainer)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        i = args[2]
        if trainer.sanity_checking:
            if self.moment == "sanity_batch" and i == self.batch:
                self._fire(trainer)
        elif self.moment == "val_batch" and (self._validations, i) == (self.nth, self.batch):
            self._fire(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validations += 1

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.moment == "epoch_end" and trainer.current_epoch == self.epoch:
            self._fire(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.moment == "checkpoint":
            if self._checkpoints == self.nth:
                self._fire(trainer)
            self._checkpoints += 1

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.moment == "train_end":
            self._fire(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.moment == "teardown" and stage == "fit":
            self._fire(trainer)

    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.moment == "test_after_fit":
            self._fire(trainer)


def _signum(name: str) -> int:
    try:
        return int(getattr(signal, name))
    except AttributeError:
        raise ValueError(f"signal={name!r} is not a signal name such as SIGTERM") from None
